//! The command-line side of the local API: a small blocking HTTP client, and the pure
//! functions that turn the API's answers into what `edgehub pods|upgrade|status|logs` print.

mod output;
pub mod txn;
mod upload;

pub use output::{columns, images_table, pods_table, status_text};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach edgehub's local API at {addr}: {reason} (is `edgehub run` running?)")]
    Connect { addr: Target, reason: String },
    #[error("local API at {addr}: {reason}")]
    Http { addr: Target, reason: String },
    #[error("writing the output: {0}")]
    Output(#[source] std::io::Error),
}

/// An answer of the local API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub body: String,
}

/// Where the local API listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Tcp(SocketAddr),
    /// The unix socket, when TCP is off.
    Unix(PathBuf),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Tcp(a) => write!(f, "{a}"),
            Target::Unix(p) => write!(f, "{}", p.display()),
        }
    }
}

/// A client for the local API: `http://<api_addr>`, or its unix socket.
#[derive(Debug, Clone)]
pub struct LocalClient {
    pub target: Target,
    pub token: Option<String>,
    pub timeout: Duration,
}

impl LocalClient {
    /// A client for the API `edgehub run` serves with `config`: its TCP address, or the unix
    /// socket when TCP is off (`api_addr = "none"`; the configuration requires a socket then).
    pub fn for_config(
        config: &crate::config::Config,
        token: Option<String>,
        timeout: Duration,
    ) -> LocalClient {
        let target = match (config.api_addr, &config.api.socket) {
            (Some(a), _) => Target::Tcp(a),
            (None, Some(p)) => Target::Unix(p.clone()),
            // Refused by the configuration's checks; the default address says where to look.
            (None, None) => Target::Tcp(SocketAddr::from(([127, 0, 0, 1], 10267))),
        };
        LocalClient {
            target,
            token,
            timeout,
        }
    }

    /// A client for the privileged routes (`POST /v1/images/load`, `PUT /v1/bootstrap-token`):
    /// the unix socket whenever one is configured, since there the kernel tells edgehub the
    /// caller is root (or in `socket_group`), which TCP cannot; TCP otherwise, where only the
    /// token opens them.
    pub fn privileged_for_config(
        config: &crate::config::Config,
        token: Option<String>,
        timeout: Duration,
    ) -> LocalClient {
        let mut c = LocalClient::for_config(config, token, timeout);
        if let Some(p) = &config.api.socket {
            c.target = Target::Unix(p.clone());
        }
        c
    }

    pub fn get(&self, path: &str) -> Result<Answer, ClientError> {
        self.call("GET", path)
    }

    pub fn post(&self, path: &str) -> Result<Answer, ClientError> {
        self.call("POST", path)
    }

    /// POSTs `body` (a transaction, a rollback's reason).
    pub fn post_body(&self, path: &str, body: &[u8]) -> Result<Answer, ClientError> {
        self.call_with("POST", path, Bytes::copy_from_slice(body))
    }

    /// PUTs `body` (`edgehub bootstrap`: the bootstrap token).
    pub fn put(&self, path: &str, body: &[u8]) -> Result<Answer, ClientError> {
        self.call_with("PUT", path, Bytes::copy_from_slice(body))
    }

    fn call(&self, method: &str, path: &str) -> Result<Answer, ClientError> {
        self.call_with(method, path, Bytes::new())
    }

    fn call_with(&self, method: &str, path: &str, body: Bytes) -> Result<Answer, ClientError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| self.http(format!("cannot start a runtime: {e}")))?;
        rt.block_on(async {
            match tokio::time::timeout(self.timeout, self.call_async(method, path, body)).await {
                Ok(r) => r,
                Err(_) => Err(self.http(format!("no answer within {:?}", self.timeout))),
            }
        })
    }

    fn http(&self, reason: String) -> ClientError {
        ClientError::Http {
            addr: self.target.clone(),
            reason,
        }
    }

    async fn call_async(
        &self,
        method: &str,
        path: &str,
        body: Bytes,
    ) -> Result<Answer, ClientError> {
        let resp = self.send(method, path, body).await?;
        self.whole(resp).await
    }

    async fn whole(&self, resp: hyper::Response<Incoming>) -> Result<Answer, ClientError> {
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| self.http(e.to_string()))?
            .to_bytes();
        Ok(Answer {
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }

    /// Connects, sends a request with `body` (often none) and returns the response head.
    async fn send(
        &self,
        method: &str,
        path: &str,
        body: Bytes,
    ) -> Result<hyper::Response<Incoming>, ClientError> {
        let connect = |e: std::io::Error| ClientError::Connect {
            addr: self.target.clone(),
            reason: e.to_string(),
        };
        // The API refuses a Host that is not a loopback name; on the socket any will do.
        let (mut send, host) = match &self.target {
            Target::Tcp(a) => {
                let s = tokio::net::TcpStream::connect(a).await.map_err(connect)?;
                (self.handshake(s).await?, a.to_string())
            }
            Target::Unix(p) => {
                let s = tokio::net::UnixStream::connect(p).await.map_err(connect)?;
                (self.handshake(s).await?, "localhost".to_string())
            }
        };
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, host);
        if let Some(t) = &self.token {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let req = req
            .body(Full::new(body))
            .map_err(|e| self.http(e.to_string()))?;
        send.send_request(req)
            .await
            .map_err(|e| self.http(e.to_string()))
    }

    async fn handshake<IO>(
        &self,
        io: IO,
    ) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>, ClientError>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
            .await
            .map_err(|e| self.http(e.to_string()))?;
        tokio::spawn(conn);
        Ok(send)
    }

    /// GETs `path` and copies a 200 answer's body into `sink` as it arrives, for
    /// `edgehub logs`. The client's timeout covers connecting and the response head only, so
    /// `logs -f` lasts as long as the container writes. `on_head` sees the 200 answer's
    /// headers before its body. Any other answer is returned whole instead. A closed `sink`
    /// (`edgehub logs | head`) ends the copy quietly.
    pub fn get_streaming(
        &self,
        path: &str,
        on_head: &mut dyn FnMut(&hyper::HeaderMap),
        sink: &mut dyn Write,
    ) -> Result<Option<Answer>, ClientError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| self.http(format!("cannot start a runtime: {e}")))?;
        rt.block_on(async {
            let resp = tokio::time::timeout(self.timeout, self.send("GET", path, Bytes::new()))
                .await
                .map_err(|_| self.http(format!("no answer within {:?}", self.timeout)))??;
            if resp.status() != hyper::StatusCode::OK {
                return tokio::time::timeout(self.timeout, self.whole(resp))
                    .await
                    .map_err(|_| self.http(format!("no answer within {:?}", self.timeout)))?
                    .map(Some);
            }
            on_head(resp.headers());
            let mut body = resp.into_body();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| self.http(e.to_string()))?;
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                match sink.write_all(&data).and_then(|()| sink.flush()) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(None),
                    Err(e) => return Err(ClientError::Output(e)),
                }
            }
            Ok(None)
        })
    }
}
/// What a command says when a privileged route answered 403 (`what`: the command, `body`:
/// the API's answer, which names the ways in; `target`: where the command called; `euid`:
/// who ran it).
pub fn forbidden(what: &str, body: &str, target: &Target, euid: u32) -> String {
    let hint = match target {
        Target::Tcp(a) => format!(
            "the configuration names no [api] socket, so this went over TCP ({a}), where any \
             local process could call and only the token of [api] token_file opens it; set \
             [api] socket in the configuration edgehub runs with (the shipped one does) and \
             run this as root"
        ),
        Target::Unix(p) if euid != 0 => format!(
            "this ran as uid {euid} over {}: run it as root (sudo {what}), or as a member of \
             the group [api] socket_group names",
            p.display()
        ),
        Target::Unix(p) => format!(
            "this ran as root over {}, and was refused all the same: is the edgehub \
             listening there the one this configuration describes?",
            p.display()
        ),
    };
    format!("{what}: refused (403): {}\nhint: {hint}", body.trim())
}

/// The API path of a pod's upgrade, from `NS/NAME`.
pub fn upgrade_path(target: &str, action: &str) -> Result<String, String> {
    let (ns, name) = target
        .split_once('/')
        .ok_or_else(|| format!("{target:?} is not NAMESPACE/NAME"))?;
    crate::names::check_label(ns).map_err(|r| format!("namespace {ns:?}: {r}"))?;
    crate::names::check_subdomain(name).map_err(|r| format!("pod name {name:?}: {r}"))?;
    Ok(format!(
        "/openyurt.io/v1/namespaces/{ns}/pods/{name}/{action}"
    ))
}

/// The options of `edgehub logs`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogsRequest<'a> {
    pub container: Option<&'a str>,
    pub follow: bool,
    pub previous: bool,
    /// The last N lines; `None` for all.
    pub tail: Option<u64>,
}

/// The API path of a container's log, from `NS/NAME` and the options of `edgehub logs`.
/// Names are checked here too, so a typo gets its reason before any request is sent.
pub fn logs_path(target: &str, req: &LogsRequest<'_>) -> Result<String, String> {
    let (ns, name) = target
        .split_once('/')
        .ok_or_else(|| format!("{target:?} is not NAMESPACE/NAME"))?;
    crate::names::check_label(ns).map_err(|r| format!("namespace {ns:?}: {r}"))?;
    crate::names::check_subdomain(name).map_err(|r| format!("pod name {name:?}: {r}"))?;
    let mut query = Vec::new();
    if let Some(c) = req.container {
        crate::names::check_label(c).map_err(|r| format!("container {c:?}: {r}"))?;
        query.push(format!("container={c}"));
    }
    if req.follow {
        query.push("follow=true".into());
    }
    if req.previous {
        query.push("previous=true".into());
    }
    if let Some(n) = req.tail {
        query.push(format!("tailLines={n}"));
    }
    let mut path = format!("/v1/namespaces/{ns}/pods/{name}/log");
    if !query.is_empty() {
        path.push('?');
        path.push_str(&query.join("&"));
    }
    Ok(path)
}

/// kubectl's notice when it chose the container itself, from a log answer's
/// `Edgehub-Container` and `Edgehub-Containers` headers (the latter is only sent then).
pub fn defaulted_notice(container: Option<&str>, containers: Option<&str>) -> Option<String> {
    Some(format!(
        "Defaulted container {:?} out of: {}",
        container?, containers?
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn images_table_prints_a_tag_the_role_and_what_gc_would_do() {
        let body = r#"{"images":[
            {"id":"sha256:a","names":["x/app@sha256:1","x/app:2"],"size":2097152,"role":"current",
             "revisions":["ns/app-2"],"removedAfterCommit":false,"removableUnderPressure":false},
            {"id":"sha256:b","names":[],"size":0,"role":"older","revisions":["ns/app-1"],
             "removedAfterCommit":true,"removableUnderPressure":true}]}"#;
        let t = images_table(body).unwrap();
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("IMAGE"), "{t}");
        assert!(
            lines[1].starts_with("x/app:2 ") && lines[1].contains("2.0 MiB"),
            "{t}"
        );
        assert!(
            lines[1].contains("current") && lines[1].ends_with("never"),
            "{t}"
        );
        assert!(
            lines[2].starts_with("sha256:b") && lines[2].ends_with("after the next commit"),
            "{t}"
        );
        assert!(images_table("not json").is_err());
    }

    use super::*;

    #[test]
    fn a_403_says_what_to_do_from_where_the_command_called() {
        let tcp = Target::Tcp("127.0.0.1:10267".parse().unwrap());
        let sock = Target::Unix("/run/edgehub/api.sock".into());
        let m = forbidden("edgehub images load", "Forbidden: x\n", &tcp, 0);
        assert!(
            m.starts_with("edgehub images load: refused (403): Forbidden: x\nhint: "),
            "{m}"
        );
        assert!(m.contains("set [api] socket"), "{m}");
        let m = forbidden("edgehub images load", "Forbidden: x", &sock, 1000);
        assert!(
            m.contains("uid 1000") && m.contains("sudo edgehub images load"),
            "{m}"
        );
        let m = forbidden("edgehub bootstrap", "Forbidden: x", &sock, 0);
        assert!(m.contains("as root over /run/edgehub/api.sock"), "{m}");
    }

    #[test]
    fn upgrade_paths() {
        assert_eq!(
            upgrade_path("vehicle/telemetry-sv74m", "upgrade").unwrap(),
            "/openyurt.io/v1/namespaces/vehicle/pods/telemetry-sv74m/upgrade"
        );
        for bad in ["nope", "/x", "a/", "A/b", "a/b/c"] {
            assert!(upgrade_path(bad, "upgrade").is_err(), "{bad}");
        }
    }

    #[test]
    fn logs_paths() {
        let all = LogsRequest::default();
        assert_eq!(
            logs_path("vehicle/telemetry-sv74m", &all).unwrap(),
            "/v1/namespaces/vehicle/pods/telemetry-sv74m/log"
        );
        let every = LogsRequest {
            container: Some("app"),
            follow: true,
            previous: true,
            tail: Some(5),
        };
        assert_eq!(
            logs_path("vehicle/p", &every).unwrap(),
            "/v1/namespaces/vehicle/pods/p/log?container=app&follow=true&previous=true&tailLines=5"
        );
        for bad in ["nope", "/x", "A/b", "a/b/c"] {
            assert!(logs_path(bad, &all).is_err(), "{bad}");
        }
        let bad_container = LogsRequest {
            container: Some("App_1"),
            ..Default::default()
        };
        assert!(logs_path("a/b", &bad_container).is_err());
    }

    #[test]
    fn the_defaulted_container_notice_is_kubectls() {
        assert_eq!(
            defaulted_notice(Some("app"), Some("app, sidecar")).unwrap(),
            "Defaulted container \"app\" out of: app, sidecar"
        );
        assert_eq!(defaulted_notice(Some("app"), None), None);
    }

    #[test]
    fn pods_table_shows_revisions_and_the_condition() {
        let body = r#"{"kind":"PodList","items":[
            {"metadata":{"name":"telemetry-sv74m","namespace":"vehicle","labels":{"controller-revision-hash":"768bcc7446"}},
             "status":{"phase":"Running","conditions":[{"type":"PodNeedUpgrade","status":"True","reason":"NewRevisionAvailable","message":"controllerrevision: 55778fbb9f"}]}},
            {"metadata":{"name":"other","namespace":"vehicle"},"status":{}}]}"#;
        let t = pods_table(body).unwrap();
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("POD"));
        assert!(
            lines[1].contains("vehicle/telemetry-sv74m")
                && lines[1].contains("768bcc7446")
                && lines[1].contains("55778fbb9f")
        );
        assert!(lines[1].contains("True (NewRevisionAvailable)") && lines[1].ends_with("Running"));
        assert!(lines[2].starts_with("vehicle/other"));
        assert!(pods_table("nope").is_err());
    }

    #[test]
    fn status_text_lists_link_cache_and_requests() {
        let body = r#"{"node":"edge-1","link":{"state":"Offline","reason":"refused"},"runtime":{"state":"Ready","version":"containerd://1.6.20"},
            "cache":{"pods":2,"daemonSets":2,"controllerRevisions":3,"nodes":1},
            "activeRequests":[{"id":1,"kind":"upgrade","namespace":"vehicle","name":"p","from":"a","to":"b","state":"Requested",
                "waiting":"the container runtime: unavailable"}]}"#;
        let t = status_text(body).unwrap();
        assert!(
            t.contains("        waiting: the container runtime: unavailable\n"),
            "{t}"
        );
        assert!(t.contains("link:   Offline (refused)"));
        assert!(t.contains("runtime: Ready (containerd://1.6.20)"));
        assert!(t.contains("2 pods, 2 DaemonSets, 3 ControllerRevisions, 1 nodes"));
        assert!(t.contains("upgrade vehicle/p a -> b [Requested] (request 1)"));
    }

    #[test]
    fn status_text_says_which_credential_lapsed_when() {
        let body = r#"{"node":"edge-1","link":{"state":"TlsFailed","reason":"unknown CA"},
            "cache":{"pods":0,"daemonSets":0,"controllerRevisions":0,"nodes":0},
            "identity":{"inUse":"nodeCertificate","nodeCertificate":{"subject":"system:node:edge-1",
              "notBefore":"2026-01-01T00:00:00Z","notAfter":"2026-02-01T00:00:00Z"},
              "bootstrap":{"source":"kubeconfig","state":"refused"},"waitingForClock":false,
              "lapsed":[{"credential":"nodeCertificate","reason":"expired","since":"2026-02-01T00:00:00Z"},
                {"credential":"bootstrap","reason":"bootstrap token refused by the apiserver (401): expired or unknown","since":"2026-06-01T10:00:00Z"}]},
            "activeRequests":[]}"#;
        let t = status_text(body).unwrap();
        assert!(t.contains("link:   TlsFailed (unknown CA)"), "{t}");
        assert!(t.contains("identity: node certificate system:node:edge-1 (valid 2026-01-01T00:00:00Z to 2026-02-01T00:00:00Z); bootstrap credential: refused (kubeconfig)"), "{t}");
        assert!(
            t.contains("lapsed: node certificate expired since 2026-02-01T00:00:00Z\n"),
            "{t}"
        );
        assert!(t.contains("lapsed: bootstrap credential bootstrap token refused by the apiserver (401): expired or unknown since 2026-06-01T10:00:00Z\n"), "{t}");
        assert!(t.contains("edgehub bootstrap --token-file FILE"), "{t}");
        // Without identity management: no identity lines.
        let plain =
            status_text(r#"{"node":"n","link":{"state":"Online"},"cache":{},"identity":null}"#)
                .unwrap();
        assert!(!plain.contains("identity:"), "{plain}");
    }
}
