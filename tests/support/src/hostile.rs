//! Hostile callers of a node's API (port 10250), for the tests and benches that check a node
//! survives them (issue 31): connections opened and left silent, and the apiserver's own
//! request made while they are held.

use crate::apiserver::kubelet::{KubeletAddr, KubeletClient};
use crate::certs::TestPki;
use http_body_util::{BodyExt, Empty};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpStream;

/// Opens `n` TCP connections to `addr` and sends nothing on them: no ClientHello, no bytes
/// at all, as a pod on the node's network can. They stay open (on this side) until the
/// returned streams are dropped; the server may close some.
pub async fn silent_connections(addr: SocketAddr, n: usize) -> std::io::Result<Vec<TcpStream>> {
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        held.push(TcpStream::connect(addr).await?);
    }
    Ok(held)
}

/// The client kube-apiserver calls a kubelet with: TLS with the kubelet-client certificate
/// `pki` issues (CN `kube-apiserver-kubelet-client`), no check of the serving certificate.
/// Made once; each request then costs what the apiserver's costs.
pub fn apiserver_client(pki: &TestPki) -> anyhow::Result<KubeletClient> {
    KubeletClient::new(pki)
}

/// `GET path` on the node API at `addr` with `client` on a new connection, as the apiserver
/// asks: the status and the whole body, the body within `body_within`.
pub async fn get(
    client: &KubeletClient,
    addr: SocketAddr,
    path: &str,
    body_within: Duration,
) -> anyhow::Result<(u16, String)> {
    let to = KubeletAddr {
        host: addr.ip().to_string(),
        port: addr.port(),
    };
    let req = hyper::Request::builder()
        .uri(path)
        .header("host", to.host_port())
        .body(Empty::<bytes::Bytes>::new())?;
    let resp = client
        .send(&to, req)
        .await
        .map_err(|e| anyhow::anyhow!("{}", e.0))?;
    let code = resp.status().as_u16();
    let body = tokio::time::timeout(body_within, resp.into_body().collect())
        .await??
        .to_bytes();
    Ok((code, String::from_utf8_lossy(&body).into_owned()))
}

/// [`get`] with a client made for this one request.
pub async fn get_as_apiserver(
    pki: &TestPki,
    addr: SocketAddr,
    path: &str,
    body_within: Duration,
) -> anyhow::Result<(u16, String)> {
    get(&apiserver_client(pki)?, addr, path, body_within).await
}
