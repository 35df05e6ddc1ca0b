//! The HTTP side of the apiserver client: one pooled HTTP/1.1-over-rustls client, requests
//! with deadlines, bodies read under a size cap, and watch streams.

use super::error::{KubeError, Request, Status};
use super::kubeconfig::{Kubeconfig, TokenSource};
use super::resource::{query, Resource};
use super::tls;
use super::watch::{parse_event, Frame, LineFramer, WatchEvent};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Method, StatusCode};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::collections::VecDeque;
use std::time::Duration;

/// Limits and deadlines of the client.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Whole-request deadline of non-watch requests; also the connect timeout.
    pub timeout: Duration,
    /// A watch that sends nothing for this long is treated as a dead link.
    pub watch_idle_timeout: Duration,
    /// Largest response body (or single watch event) accepted.
    pub max_body: usize,
    /// The node edgehub runs as, for error hints.
    pub node_name: String,
}

/// The apiserver client. Cheap to clone: the connection pool is shared.
#[derive(Clone)]
pub struct ApiClient {
    http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    server: String,
    token: Option<TokenSource>,
    opts: ClientOptions,
}

/// Query parameters of a list or watch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListParams {
    pub field_selector: Option<String>,
    pub label_selector: Option<String>,
}

/// How long the apiserver's watch cache waits for a resourceVersion it does not have before
/// it answers "too large" (`blockTimeout` in k8s.io/apiserver's watch_cache.go).
const WATCH_CACHE_BLOCK: Duration = Duration::from_secs(3);

/// One page of a list: the raw items and the list's metadata.
#[derive(Debug)]
pub struct ListPage {
    pub resource_version: String,
    pub continue_token: Option<String>,
    /// Raw JSON of each item as the apiserver sent it.
    pub items: Vec<String>,
}

#[derive(Deserialize)]
struct RawList<'a> {
    #[serde(default)]
    metadata: ListMeta,
    #[serde(borrow, default)]
    items: Vec<&'a RawValue>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ListMeta {
    #[serde(default)]
    resource_version: String,
    #[serde(default, rename = "continue")]
    continue_token: Option<String>,
}

/// The patch formats the apiserver takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    Merge,
    StrategicMerge,
}

impl PatchType {
    fn content_type(self) -> &'static str {
        match self {
            PatchType::Merge => "application/merge-patch+json",
            PatchType::StrategicMerge => "application/strategic-merge-patch+json",
        }
    }
}

/// Why a client could not be built from the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ClientSetupError {
    #[error(transparent)]
    Kubeconfig(#[from] super::KubeconfigError),
    #[error("kubeconfig {path}: {source}")]
    Tls {
        path: std::path::PathBuf,
        #[source]
        source: tls::TlsSetupError,
    },
}

impl ApiClient {
    /// Builds the client. Fails only on bad TLS material; no connection is made yet.
    pub fn new(kc: &Kubeconfig, opts: ClientOptions) -> Result<ApiClient, tls::TlsSetupError> {
        let tls = tls::client_config(
            &kc.ca_pem,
            kc.client_cert
                .as_ref()
                .map(|(c, k)| (c.as_slice(), k.as_slice())),
        )?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(opts.timeout));
        http.set_nodelay(true);
        // TCP keepalive finds a dead cellular link under an idle watch sooner than the idle
        // timeout would.
        http.set_keepalive(Some(Duration::from_secs(30)));
        let builder = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_only();
        let https = match &kc.tls_server_name {
            Some(name) => builder
                .with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(
                    name.clone().try_into().map_err(|_| {
                        tls::TlsSetupError::Ca(format!(
                            "tls-server-name {name:?} is not a valid name"
                        ))
                    })?,
                ))
                .enable_http1()
                .wrap_connector(http),
            None => builder.enable_http1().wrap_connector(http),
        };
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(4)
            .build(https);
        Ok(ApiClient {
            http: client,
            server: kc.server.clone(),
            token: kc.token.clone(),
            opts,
        })
    }

    pub fn server(&self) -> &str {
        &self.server
    }

    fn request_desc(
        verb: &'static str,
        res: &Resource,
        sub: Option<&str>,
        ns: Option<&str>,
        name: Option<&str>,
    ) -> Request {
        let mut resource = res.qualified();
        if let Some(s) = sub {
            resource.push('/');
            resource.push_str(s);
        }
        Request {
            verb,
            resource,
            namespace: ns.filter(|_| res.namespaced).map(str::to_string),
            name: name.map(str::to_string),
        }
    }

    /// Sends a request and returns the response once its head has arrived. Non-2xx answers
    /// are turned into [`KubeError::Status`].
    async fn send(
        &self,
        request: &Request,
        method: Method,
        path_and_query: &str,
        body: Option<(&'static str, Vec<u8>)>,
    ) -> Result<hyper::Response<Incoming>, KubeError> {
        self.send_within(request, method, path_and_query, body, self.opts.timeout)
            .await
    }

    /// [`ApiClient::send`] with a deadline of its own for the response's head.
    async fn send_within(
        &self,
        request: &Request,
        method: Method,
        path_and_query: &str,
        body: Option<(&'static str, Vec<u8>)>,
        timeout: Duration,
    ) -> Result<hyper::Response<Incoming>, KubeError> {
        let uri = format!("{}{}", self.server, path_and_query);
        let mut builder = hyper::Request::builder()
            .method(method)
            .uri(&uri)
            .header(ACCEPT, "application/json")
            .header(
                hyper::header::USER_AGENT,
                concat!("edgehub/", env!("CARGO_PKG_VERSION")),
            );
        if let Some(tok) = &self.token {
            let t = tok.read().map_err(|e| KubeError::Stream {
                request: request.clone(),
                reason: format!("cannot read the kubeconfig's token file: {e}"),
            })?;
            let v =
                HeaderValue::from_str(&format!("Bearer {t}")).map_err(|_| KubeError::Stream {
                    request: request.clone(),
                    reason: "the bearer token contains characters not allowed in a header".into(),
                })?;
            builder = builder.header(AUTHORIZATION, v);
        }
        let body = match body {
            Some((ct, b)) => {
                builder = builder.header(CONTENT_TYPE, ct);
                Full::new(Bytes::from(b))
            }
            None => Full::new(Bytes::new()),
        };
        let req = builder.body(body).map_err(|e| KubeError::Stream {
            request: request.clone(),
            reason: format!("cannot build request for {uri}: {e}"),
        })?;
        let resp = match tokio::time::timeout(timeout, self.http.request(req)).await {
            Err(_) => {
                return Err(KubeError::Timeout {
                    request: request.clone(),
                    timeout,
                })
            }
            Ok(Err(e)) => return Err(self.classify(request, &e)),
            Ok(Ok(r)) => r,
        };
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let retry_after = resp
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        // A Status body is small; cap what we read of an error body.
        let body = self
            .read_body(request, resp, 64 << 10)
            .await
            .unwrap_or_default();
        Err(KubeError::Status {
            request: request.clone(),
            status: Status::from_body(status.as_u16(), &body),
            retry_after: if status == StatusCode::TOO_MANY_REQUESTS
                || status == StatusCode::SERVICE_UNAVAILABLE
            {
                retry_after
            } else {
                None
            },
            node: self.opts.node_name.clone(),
        })
    }

    /// Reads a whole body, refusing more than `limit` bytes.
    async fn read_body(
        &self,
        request: &Request,
        resp: hyper::Response<Incoming>,
        limit: usize,
    ) -> Result<Bytes, KubeError> {
        let mut body = resp.into_body();
        let mut out = Vec::new();
        let read = async {
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| KubeError::Stream {
                    request: request.clone(),
                    reason: format!("connection lost while reading the response: {e}"),
                })?;
                if let Some(d) = frame.data_ref() {
                    if out.len() + d.len() > limit {
                        return Err(KubeError::TooLarge {
                            request: request.clone(),
                            limit,
                        });
                    }
                    out.extend_from_slice(d);
                }
            }
            Ok(())
        };
        match tokio::time::timeout(self.opts.timeout, read).await {
            Err(_) => Err(KubeError::Timeout {
                request: request.clone(),
                timeout: self.opts.timeout,
            }),
            Ok(r) => r.map(|()| Bytes::from(out)),
        }
    }

    async fn call(
        &self,
        request: Request,
        method: Method,
        path: &str,
        body: Option<(&'static str, Vec<u8>)>,
    ) -> Result<String, KubeError> {
        let resp = self.send(&request, method, path, body).await?;
        let bytes = self.read_body(&request, resp, self.opts.max_body).await?;
        String::from_utf8(bytes.to_vec()).map_err(|e| KubeError::Stream {
            request,
            reason: format!("response is not UTF-8: {e}"),
        })
    }

    /// One page of a list. `resource_version` "0" lets the apiserver answer from its cache.
    pub async fn list(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        params: &ListParams,
        limit: Option<u32>,
        continue_token: Option<&str>,
    ) -> Result<ListPage, KubeError> {
        let request = Self::request_desc("list", res, None, namespace, None);
        let limit_s = limit.map(|l| l.to_string());
        let path = format!(
            "{}{}",
            res.collection_path(namespace),
            query(&[
                ("fieldSelector", params.field_selector.as_deref()),
                ("labelSelector", params.label_selector.as_deref()),
                ("limit", limit_s.as_deref()),
                ("continue", continue_token),
            ])
        );
        let resp = self.send(&request, Method::GET, &path, None).await?;
        let body = self.read_body(&request, resp, self.opts.max_body).await?;
        let list: RawList = serde_json::from_slice(&body).map_err(|source| KubeError::Decode {
            request: request.clone(),
            source,
        })?;
        if list.metadata.resource_version.is_empty() {
            return Err(KubeError::Stream {
                request,
                reason: "list response has no metadata.resourceVersion".into(),
            });
        }
        Ok(ListPage {
            resource_version: list.metadata.resource_version,
            continue_token: list.metadata.continue_token.filter(|c| !c.is_empty()),
            items: list.items.iter().map(|r| r.get().to_string()).collect(),
        })
    }

    /// Asks whether the server has reached `resource_version`: a list of at most one item
    /// with `resourceVersionMatch=NotOlderThan`, served from the apiserver's watch cache. A
    /// version the server does not have yet answers 504 "Too large resource version" (see
    /// [`KubeError::is_resource_version_too_large`]) once the cache has waited 3 s for it. A
    /// watch from such a version is accepted and stays silent until the server's versions
    /// pass it, so this is the only way a client learns that its cursor is ahead.
    pub async fn check_resource_version(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        params: &ListParams,
        resource_version: &str,
    ) -> Result<(), KubeError> {
        let request = Self::request_desc("list", res, None, namespace, None);
        let path = format!(
            "{}{}",
            res.collection_path(namespace),
            query(&[
                ("fieldSelector", params.field_selector.as_deref()),
                ("labelSelector", params.label_selector.as_deref()),
                ("limit", Some("1")),
                ("resourceVersion", Some(resource_version)),
                ("resourceVersionMatch", Some("NotOlderThan")),
            ])
        );
        // The watch cache holds the request up to 3 s waiting for the version before it
        // answers: that is on top of the usual deadline, or the answer is never seen.
        let timeout = self.opts.timeout + WATCH_CACHE_BLOCK;
        let resp = self
            .send_within(&request, Method::GET, &path, None, timeout)
            .await?;
        self.read_body(&request, resp, self.opts.max_body).await?;
        Ok(())
    }

    /// Starts a watch from `resource_version` with bookmarks on. The server ends it after
    /// `timeout_seconds`; the caller then watches again from the last version it saw.
    pub async fn watch(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        params: &ListParams,
        resource_version: &str,
        timeout_seconds: u32,
    ) -> Result<WatchStream, KubeError> {
        let request = Self::request_desc("watch", res, None, namespace, None);
        let timeout_s = timeout_seconds.to_string();
        let path = format!(
            "{}{}",
            res.collection_path(namespace),
            query(&[
                ("fieldSelector", params.field_selector.as_deref()),
                ("labelSelector", params.label_selector.as_deref()),
                ("watch", Some("1")),
                ("resourceVersion", Some(resource_version)),
                ("allowWatchBookmarks", Some("true")),
                ("timeoutSeconds", Some(&timeout_s)),
            ])
        );
        let resp = self.send(&request, Method::GET, &path, None).await?;
        Ok(WatchStream {
            body: resp.into_body(),
            framer: LineFramer::new(self.opts.max_body),
            pending: VecDeque::new(),
            idle: self.opts.watch_idle_timeout,
            request,
            ended: false,
        })
    }

    /// GET one object (raw JSON).
    pub async fn get(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<String, KubeError> {
        let request = Self::request_desc("get", res, None, namespace, Some(name));
        self.call(
            request,
            Method::GET,
            &res.object_path(namespace, name, None),
            None,
        )
        .await
    }

    /// POST a new object.
    pub async fn create(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        body: Vec<u8>,
    ) -> Result<String, KubeError> {
        let request = Self::request_desc("create", res, None, namespace, None);
        self.call(
            request,
            Method::POST,
            &res.collection_path(namespace),
            Some(("application/json", body)),
        )
        .await
    }

    /// POST to a subresource of an object, such as `serviceaccounts/NAME/token`.
    pub async fn create_sub(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        name: &str,
        sub: &str,
        body: Vec<u8>,
    ) -> Result<String, KubeError> {
        let request = Self::request_desc("create", res, Some(sub), namespace, Some(name));
        self.call(
            request,
            Method::POST,
            &res.object_path(namespace, name, Some(sub)),
            Some(("application/json", body)),
        )
        .await
    }

    /// PUT (replace) an object; the body's `metadata.resourceVersion` makes it conditional.
    pub async fn update(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        name: &str,
        body: Vec<u8>,
    ) -> Result<String, KubeError> {
        let request = Self::request_desc("update", res, None, namespace, Some(name));
        self.call(
            request,
            Method::PUT,
            &res.object_path(namespace, name, None),
            Some(("application/json", body)),
        )
        .await
    }

    /// PATCH an object or one of its subresources (`status`).
    pub async fn patch(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        name: &str,
        sub: Option<&str>,
        patch: PatchType,
        body: Vec<u8>,
    ) -> Result<String, KubeError> {
        let request = Self::request_desc("patch", res, sub, namespace, Some(name));
        self.call(
            request,
            Method::PATCH,
            &res.object_path(namespace, name, sub),
            Some((patch.content_type(), body)),
        )
        .await
    }

    /// DELETE an object, optionally only if its uid still matches.
    pub async fn delete(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        name: &str,
        uid_precondition: Option<&str>,
        grace_period_seconds: Option<i64>,
    ) -> Result<String, KubeError> {
        let request = Self::request_desc("delete", res, None, namespace, Some(name));
        let mut opts = serde_json::json!({"apiVersion": "v1", "kind": "DeleteOptions"});
        if let Some(g) = grace_period_seconds {
            opts["gracePeriodSeconds"] = g.into();
        }
        if let Some(uid) = uid_precondition {
            opts["preconditions"] = serde_json::json!({ "uid": uid });
        }
        self.call(
            request,
            Method::DELETE,
            &res.object_path(namespace, name, None),
            Some(("application/json", opts.to_string().into_bytes())),
        )
        .await
    }

    /// Maps a transport error: TLS verification failures are told apart from "offline".
    fn classify(&self, request: &Request, e: &(dyn std::error::Error + 'static)) -> KubeError {
        let mut chain = Vec::new();
        let mut tls_failure = None;
        let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(err) = cur {
            chain.push(err.to_string());
            tls_failure = tls_failure.or_else(|| rustls_error_in(err));
            cur = err.source();
        }
        chain.dedup();
        match tls_failure {
            Some(reason) => KubeError::Tls {
                request: request.clone(),
                server: self.server.clone(),
                reason,
            },
            None => KubeError::Unreachable {
                request: request.clone(),
                server: self.server.clone(),
                reason: chain.join(": "),
            },
        }
    }
}

/// Finds a rustls error in `err`, looking through nested `io::Error` wrappers: hyper-rustls
/// wraps tokio-rustls's `io::Error` in another one, and `io::Error::source` skips a level.
fn rustls_error_in(err: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur = err;
    loop {
        if let Some(r) = cur.downcast_ref::<rustls::Error>() {
            return Some(r.to_string());
        }
        match cur
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => cur = inner,
            None => return None,
        }
    }
}

/// A running watch, read event by event.
pub struct WatchStream {
    body: Incoming,
    framer: LineFramer,
    pending: VecDeque<Frame>,
    idle: Duration,
    request: Request,
    ended: bool,
}

impl WatchStream {
    /// The next event; `Ok(None)` when the server ended the watch cleanly (its timeout).
    /// A connection cut in the middle of an event is an error, and that partial event is
    /// discarded: watching again from the last resourceVersion replays it.
    pub async fn next(&mut self) -> Result<Option<WatchEvent>, KubeError> {
        loop {
            if let Some(frame) = self.pending.pop_front() {
                return Ok(Some(match frame {
                    Frame::Line(l) => parse_event(&l),
                    Frame::Oversized { bytes } => WatchEvent::Malformed {
                        reason: format!("event of {bytes} bytes is over the size cap; dropped"),
                    },
                }));
            }
            if self.ended {
                return Ok(None);
            }
            let frame = match tokio::time::timeout(self.idle, self.body.frame()).await {
                Err(_) => {
                    return Err(KubeError::Timeout {
                        request: self.request.clone(),
                        timeout: self.idle,
                    })
                }
                Ok(f) => f,
            };
            match frame {
                None => {
                    self.ended = true;
                    let cut = self.framer.pending();
                    if cut > 0 {
                        return Err(KubeError::Stream {
                            request: self.request.clone(),
                            reason: format!(
                                "watch stream ended in the middle of an event ({cut} bytes)"
                            ),
                        });
                    }
                }
                Some(Err(e)) => {
                    self.ended = true;
                    return Err(KubeError::Stream {
                        request: self.request.clone(),
                        reason: format!("watch connection lost: {e}"),
                    });
                }
                Some(Ok(f)) => {
                    if let Some(d) = f.data_ref() {
                        self.pending.extend(self.framer.push(d));
                    }
                }
            }
        }
    }
}
