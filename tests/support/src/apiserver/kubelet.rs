//! The apiserver's side of a connection to a kubelet (port 10250): TLS with the
//! kubelet-client certificate the fake issues from its client CA (CN
//! `kube-apiserver-kubelet-client`, as kubeadm's `apiserver-kubelet-client.crt`), and, like a
//! kube-apiserver without `--kubelet-certificate-authority`, no check of the kubelet's serving
//! certificate. Which address and port: the Node's `status.addresses` in kubeadm's
//! `--kubelet-preferred-address-types=InternalIP,ExternalIP,Hostname` order, and
//! `status.daemonEndpoints.kubeletEndpoint.Port` (10250, `--kubelet-port`, when it is 0).

use super::{Body, TestPki, APISERVER_KUBELET_CLIENT};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;

/// kube-apiserver's `--kubelet-port` default, used when a Node advertises port 0.
const DEFAULT_KUBELET_PORT: u64 = 10250;

/// The group of kubeadm's kubelet-client certificate since v1.29 (not `system:masters`): the
/// kubelet's SubjectAccessReview must allow it by its user's binding.
const KUBELET_CLIENT_GROUP: &str = "kubeadm:cluster-admins";

/// Where a Node's kubelet listens: a host (an IP or a name) and a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeletAddr {
    pub host: String,
    pub port: u16,
}

impl KubeletAddr {
    /// `host:port`, with brackets for IPv6, as Go's `net.JoinHostPort`.
    pub fn host_port(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// The kubelet's address from a Node object, or None when it reports no usable address.
pub fn kubelet_addr(node: &Value) -> Option<KubeletAddr> {
    let addrs = node.pointer("/status/addresses")?.as_array()?;
    let host = ["InternalIP", "ExternalIP", "Hostname"]
        .iter()
        .find_map(|t| {
            addrs
                .iter()
                .find(|a| a["type"] == *t)
                .and_then(|a| a["address"].as_str())
                .filter(|a| !a.is_empty())
        })?
        .to_string();
    let port = node
        .pointer("/status/daemonEndpoints/kubeletEndpoint/Port")
        .and_then(Value::as_u64)
        .filter(|p| *p > 0)
        .unwrap_or(DEFAULT_KUBELET_PORT);
    Some(KubeletAddr {
        host,
        port: u16::try_from(port).ok()?,
    })
}

/// Accepts any serving certificate: the apiserver without `--kubelet-certificate-authority`.
#[derive(Debug)]
struct AnyServerCert(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyServerCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Why a request did not reach the kubelet, worded as Go's dialer does
/// (`dial tcp 127.0.0.1:1: connect: connection refused`).
#[derive(Debug)]
pub struct DialError(pub String);

/// The apiserver's kubelet client.
pub struct KubeletClient {
    tls: Arc<rustls::ClientConfig>,
}

impl KubeletClient {
    pub fn new(pki: &TestPki) -> anyhow::Result<KubeletClient> {
        let cert = pki.client_cert(APISERVER_KUBELET_CLIENT, KUBELET_CLIENT_GROUP)?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyServerCert(provider)))
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_slice(cert.cert_pem.as_bytes())?],
                PrivateKeyDer::from_pem_slice(cert.key_pem.as_bytes())?,
            )?;
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(KubeletClient { tls: Arc::new(cfg) })
    }

    /// Sends one request on a new connection (with upgrades, for exec and friends).
    pub async fn send<B>(
        &self,
        to: &KubeletAddr,
        req: Request<B>,
    ) -> Result<Response<Incoming>, DialError>
    where
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let dial = |e: std::io::Error| {
            let what = match e.kind() {
                std::io::ErrorKind::ConnectionRefused => "connect: connection refused".to_string(),
                std::io::ErrorKind::TimedOut => "i/o timeout".to_string(),
                _ => e.to_string(),
            };
            DialError(format!("dial tcp {}: {what}", to.host_port()))
        };
        let tcp = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::net::TcpStream::connect((to.host.as_str(), to.port)),
        )
        .await
        .map_err(|_| dial(std::io::ErrorKind::TimedOut.into()))?
        .map_err(dial)?;
        let name = ServerName::try_from(to.host.clone())
            .map_err(|e| DialError(format!("invalid kubelet host {}: {e}", to.host)))?;
        let tls = tokio_rustls::TlsConnector::from(self.tls.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| DialError(format!("tls: {e}")))?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
                .await
                .map_err(|e| DialError(e.to_string()))?;
        tokio::spawn(conn.with_upgrades());
        sender
            .send_request(req)
            .await
            .map_err(|e| DialError(e.to_string()))
    }
}

/// A kubelet's response body as the fake's own body type.
pub fn relay_body(b: Incoming) -> Body {
    b.map_err(std::io::Error::other).boxed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_internal_ip_first_and_the_advertised_port() {
        let node = json!({"status": {
            "addresses": [{"type": "Hostname", "address": "edge-1"}, {"type": "InternalIP", "address": "10.0.0.7"}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10255}}}});
        assert_eq!(
            kubelet_addr(&node),
            Some(KubeletAddr {
                host: "10.0.0.7".into(),
                port: 10255
            })
        );
        let node = json!({"status": {"addresses": [{"type": "Hostname", "address": "edge-1"}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}}}});
        assert_eq!(kubelet_addr(&node).unwrap().port, 10250);
        assert_eq!(kubelet_addr(&node).unwrap().host, "edge-1");
        assert_eq!(kubelet_addr(&json!({"status": {}})), None);
        let v6 = KubeletAddr {
            host: "fd00::1".into(),
            port: 1,
        };
        assert_eq!(v6.host_port(), "[fd00::1]:1");
    }
}
