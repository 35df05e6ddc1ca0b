//! A bare HTTPS client for replaying recorded requests exactly as they were made (method,
//! path with query, content type, body) against the fake apiserver.

use crate::FakeApiServer;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;

/// A client certificate and its key, both PEM, presented in the handshake.
pub struct ClientPem<'a> {
    pub cert: &'a str,
    pub key: &'a str,
}

async fn connect(
    server: &FakeApiServer,
    client: Option<&ClientPem<'_>>,
) -> anyhow::Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(
        server.pki.ca_pem.as_bytes(),
    )?)?;
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots);
    let cfg = match client {
        None => cfg.with_no_client_auth(),
        Some(c) => cfg.with_client_auth_cert(
            vec![CertificateDer::from_pem_slice(c.cert.as_bytes())?],
            rustls::pki_types::PrivateKeyDer::from_pem_slice(c.key.as_bytes())?,
        )?,
    };
    let tcp = tokio::net::TcpStream::connect(server.addr).await?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from("127.0.0.1")?.to_owned(), tcp)
        .await?;
    let (send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls)).await?;
    tokio::spawn(conn.with_upgrades());
    Ok(send)
}

fn build(
    token: Option<&str>,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: Option<&Value>,
) -> anyhow::Result<hyper::Request<Full<Bytes>>> {
    let mut b = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "127.0.0.1");
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    if let Some(ct) = content_type {
        b = b.header("content-type", ct);
    }
    let body = body
        .map(serde_json::to_vec)
        .transpose()?
        .unwrap_or_default();
    Ok(b.body(Full::new(Bytes::from(body)))?)
}

impl FakeApiServer {
    /// Sends one request and returns the status code and the JSON body.
    pub async fn raw(
        &self,
        token: Option<&str>,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: Option<&Value>,
    ) -> anyhow::Result<(u16, Value)> {
        self.raw_as(token, None, method, path, content_type, body)
            .await
    }

    /// [`Self::raw`] with a client certificate in the handshake as well (or instead).
    pub async fn raw_as(
        &self,
        token: Option<&str>,
        client: Option<&ClientPem<'_>>,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: Option<&Value>,
    ) -> anyhow::Result<(u16, Value)> {
        let mut send = connect(self, client).await?;
        let resp = send
            .send_request(build(token, method, path, content_type, body)?)
            .await?;
        let code = resp.status().as_u16();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok((code, serde_json::from_slice(&bytes)?))
    }

    /// Starts a watch and returns the status code and the events received within `wait`
    /// (at most `max` of them). The chunked stream is read event by event.
    pub async fn raw_watch(
        &self,
        token: Option<&str>,
        path: &str,
        max: usize,
        wait: Duration,
    ) -> anyhow::Result<(u16, Vec<Value>)> {
        self.raw_watch_as(token, None, path, max, wait).await
    }

    /// [`Self::raw_watch`] with a client certificate in the handshake.
    pub async fn raw_watch_as(
        &self,
        token: Option<&str>,
        client: Option<&ClientPem<'_>>,
        path: &str,
        max: usize,
        wait: Duration,
    ) -> anyhow::Result<(u16, Vec<Value>)> {
        let mut send = connect(self, client).await?;
        let resp = send
            .send_request(build(token, "GET", path, None, None)?)
            .await?;
        let code = resp.status().as_u16();
        let mut body = resp.into_body();
        let mut buf = Vec::new();
        let mut events = Vec::new();
        let deadline = tokio::time::Instant::now() + wait;
        while events.len() < max {
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) | Ok(None) => break,
                Ok(Some(f)) => f?,
            };
            if let Some(d) = frame.data_ref() {
                buf.extend_from_slice(d);
                while let Some(i) = buf.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = buf.drain(..=i).collect();
                    events.push(serde_json::from_slice(&line)?);
                }
            }
        }
        Ok((code, events))
    }

    /// A request with extra headers whose answer may be anything (text, JSON, a stream cut
    /// short, an upgrade): what the node proxy answers. The body is read for at most `wait`.
    pub async fn raw_any(
        &self,
        token: Option<&str>,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        wait: Duration,
    ) -> anyhow::Result<RawAnswer> {
        let mut send = connect(self, None).await?;
        let mut req = build(token, method, path, None, None)?;
        for (k, v) in headers {
            req.headers_mut().append(
                hyper::header::HeaderName::from_bytes(k.as_bytes())?,
                hyper::header::HeaderValue::from_str(v)?,
            );
        }
        let resp = send.send_request(req).await?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        if status == 101 {
            let upgraded = hyper::upgrade::on(resp).await?;
            return Ok(RawAnswer {
                status,
                headers,
                body: Vec::new(),
                upgraded: Some(hyper_util::rt::TokioIo::new(upgraded)),
            });
        }
        let mut body = resp.into_body();
        let mut buf = Vec::new();
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) | Ok(None) => break,
                Ok(Some(f)) => {
                    if let Some(d) = f?.data_ref() {
                        buf.extend_from_slice(d);
                    }
                }
            }
        }
        Ok(RawAnswer {
            status,
            headers,
            body: buf,
            upgraded: None,
        })
    }
}

/// What [`FakeApiServer::raw_any`] got.
pub struct RawAnswer {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Vec<u8>,
    /// The connection after a 101, to speak the upgraded protocol on.
    pub upgraded: Option<hyper_util::rt::TokioIo<hyper::upgrade::Upgraded>>,
}

impl RawAnswer {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}
