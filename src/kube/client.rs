//! The HTTP side of the apiserver client: one pooled HTTP/1.1-over-rustls client, requests
//! with deadlines, bodies read under a size cap, and transport errors told apart (the verbs
//! are in `verbs`, watch streams in `stream`).

use super::error::{KubeError, Request, Status};
use super::kubeconfig::Kubeconfig;
use super::resource::Resource;
use super::tls;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Method, StatusCode};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::time::Duration;

/// The read buffer of each connection to the apiserver (see `transport`).
const READ_BUF: usize = 16 << 10;

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

/// The apiserver client. Cheap to clone: the connection pool and the credential are shared,
/// so a credential swapped in ([`ApiClient::set_credential`]) is what every clone sends next.
#[derive(Clone)]
pub struct ApiClient {
    pub(super) cred: super::credential::Shared,
    pub(super) server: String,
    pub(super) opts: ClientOptions,
}

type Http = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

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
        let http = Self::transport(kc, &opts)?;
        Ok(ApiClient {
            cred: super::credential::Shared::new(http, kc.token.clone()),
            server: kc.server.clone(),
            opts,
        })
    }

    /// From now on every request (of every clone) goes out with `kc`'s credentials, over new
    /// connections; requests already under way, and open watches, finish on the old ones.
    /// `kc` must name the same server.
    pub fn set_credential(&self, kc: &Kubeconfig) -> Result<(), tls::TlsSetupError> {
        let http = Self::transport(kc, &self.opts)?;
        self.cred.set(http, kc.token.clone());
        Ok(())
    }

    /// No request goes out until [`ApiClient::set_credential`]: each fails as offline
    /// ([`KubeError::Unreachable`]) with `reason`, so nothing is parked or dropped for it.
    pub fn clear_credential(&self, reason: &str) {
        self.cred.clear(reason);
    }

    /// What the credential in use has met: its generation and the 401s it got.
    pub fn credential_state(&self) -> super::credential::CredentialState {
        self.cred.state()
    }

    fn transport(kc: &Kubeconfig, opts: &ClientOptions) -> Result<Http, tls::TlsSetupError> {
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
        Ok(Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(4)
            // A fixed read buffer: hyper's adaptive one grows while reads fill it, up to
            // ~400 KiB on a pod list, and a connection keeps what it grew to, idle in the pool
            // or carrying a watch afterwards: 496 KiB of the idle heap with 100 pods cached
            // (valgrind's massif on benches/footprint.rs). 16 KiB is a TLS record; a large
            // list takes more reads, a few microseconds each.
            .http1_read_buf_exact_size(READ_BUF)
            .build(https))
    }

    pub fn server(&self) -> &str {
        &self.server
    }

    pub(super) fn request_desc(
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
    pub(super) async fn send(
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
    pub(super) async fn send_within(
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
        let cred = self
            .cred
            .current()
            .map_err(|reason| KubeError::Unreachable {
                request: request.clone(),
                server: self.server.clone(),
                reason,
            })?;
        if let Some(tok) = &cred.token {
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
        let resp = match tokio::time::timeout(timeout, cred.http.request(req)).await {
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
        // Any answer but a 401 means the credential authenticated (a 404 or 403 comes after
        // authentication).
        if status == StatusCode::UNAUTHORIZED {
            self.cred.unauthorized(cred.generation);
        } else {
            self.cred.worked(cred.generation);
        }
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
    pub(super) async fn read_body(
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

    pub(super) async fn call(
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
            return Some(super::tls_error::describe(r));
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
