//! The node API (port 10250) served in the test's own process against the fake apiserver,
//! for `tests/kubelet_api.rs` and `tests/kubelet_hostile.rs`: a serving certificate issued
//! through a kubelet-serving CSR, the client CA, a pod in the cache with CRI-format log
//! files (what containerd writes; here written by the test), and clients with a bearer
//! token, a client certificate or nothing. Included by `#[path]`.
#![allow(dead_code)]

use edgehub::identity::serving::{Sans, ServingCert};
use edgehub::kube::{ApiClient, ClientOptions, Kubeconfig};
use edgehub::kubelet_api::reviews::{CacheTtl, Reviewer};
use edgehub::kubelet_api::{KubeletApi, KubeletApiConfig};
use edgehub::object::Kind;
use edgehub::store::{Change, OpenMode, Store, StoredObject};
use edgehub_testsupport::{
    Approval, FakeApiServer, ADMIN_TOKEN, KUBELET_SERVING_SIGNER, NODE_TOKEN, NODE_USER,
};
use http_body_util::{BodyExt, Empty};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::json;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

pub const JANE: &str = "jane-token";

pub struct Env {
    pub s: FakeApiServer,
    _dir: tempfile::TempDir,
    pub data: PathBuf,
    pub addr: SocketAddr,
    _stop: watch::Sender<bool>,
}

pub fn opts() -> ClientOptions {
    ClientOptions {
        timeout: Duration::from_secs(5),
        watch_idle_timeout: Duration::from_secs(30),
        max_body: 4 << 20,
        node_name: "edge-1".into(),
    }
}

pub async fn env(cfg: KubeletApiConfig) -> Env {
    let s = FakeApiServer::start().await.unwrap();
    s.add_token(JANE, "jane");
    // An approver for serving CSRs of the node that asks (the controller's, next).
    s.set_csr_approver(Some(Arc::new(|req: &edgehub_testsupport::CsrRequest| {
        if req.signer_name == KUBELET_SERVING_SIGNER && req.username == NODE_USER {
            Approval::Approve {
                reason: "TestApproved".into(),
                message: "serving CSR of the node itself".into(),
            }
        } else {
            Approval::Pending
        }
    })));
    let dir = tempfile::tempdir().unwrap();
    let kc = s
        .write_kubeconfig(&dir.path().join("etc"), NODE_TOKEN)
        .unwrap();
    let client = ApiClient::new(&Kubeconfig::load(&kc).unwrap(), opts()).unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let (task, mut serving) = ServingCert::setup(
        client.clone(),
        &data,
        "edge-1",
        Arc::new(|| Sans {
            dns: vec!["edge-1".into()],
            ips: vec!["127.0.0.1".parse().unwrap()],
        }),
        None,
        false,
    )
    .unwrap();
    let (stop, stop_rx) = watch::channel(false);
    tokio::spawn(task.run(stop_rx.clone()));
    tokio::time::timeout(Duration::from_secs(10), serving.wait_for(|p| p.is_some()))
        .await
        .expect("a serving certificate")
        .unwrap();
    let store = Arc::new(Store::open(&data.join("edgehub.db"), OpenMode::Normal).unwrap());
    let ca = dir.path().join("client-ca.crt");
    std::fs::write(&ca, &s.pki.ca_pem).unwrap();
    let cfg = KubeletApiConfig {
        client_ca_file: Some(ca),
        ..cfg
    };
    let reviewer = Reviewer::new(client, "edge-1", CacheTtl::default());
    let api = Arc::new(
        KubeletApi::new(
            &cfg,
            "edge-1",
            None,
            reviewer,
            store.clone(),
            &data,
            serving,
        )
        .unwrap(),
    );
    let listener = KubeletApi::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(api.serve(listener, stop_rx));
    seed_pod(&store, &data);
    Env {
        s,
        _dir: dir,
        data,
        addr,
        _stop: stop,
    }
}

pub fn config() -> KubeletApiConfig {
    KubeletApiConfig {
        addr: Some("127.0.0.1:0".parse().unwrap()),
        max_streams: 2,
        idle_timeout: Duration::from_secs(2),
        ..KubeletApiConfig::default()
    }
}

pub const UID: &str = "6f1c0a52-8c1e-4bde-9a77-0f8a3a1f0a01";

pub fn rfc3339(unix: u64) -> String {
    edgehub_testsupport::apiserver::rfc3339(unix as i64)
}

pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

pub fn log_dir(data: &std::path::Path) -> PathBuf {
    data.join("pods").join(UID).join("logs")
}

/// The pod in the cache, its first attempt's log (an hour old) and its second (a split line,
/// then recent lines).
pub fn seed_pod(store: &Store, data: &std::path::Path) {
    let pod = json!({"metadata": {"name": "web", "namespace": "vehicle", "uid": UID, "resourceVersion": "1"},
        "spec": {"nodeName": "edge-1", "containers": [{"name": "app", "image": "busybox"}]},
        "status": {"phase": "Running"}});
    store
        .apply(
            Kind::Pod,
            &[Change::Upsert(
                StoredObject::from_raw(Kind::Pod, pod.to_string()).unwrap(),
            )],
            None,
        )
        .unwrap();
    let dir = log_dir(data);
    std::fs::create_dir_all(&dir).unwrap();
    let old = rfc3339(now() - 3600);
    std::fs::write(
        dir.join("app_0.log"),
        format!("{old} stdout F first run\n{old} stderr F crashed\n"),
    )
    .unwrap();
    let recent = rfc3339(now() - 5);
    std::fs::write(
        dir.join("app_1.log"),
        format!(
            "{old} stdout F one\n{old} stdout P tw\n{old} stdout F o\n{recent} stdout F three\n{recent} stderr F four\n"
        ),
    )
    .unwrap();
}

pub enum Cred<'a> {
    None,
    Token(&'a str),
    Cert(&'a str, &'a str),
}

pub async fn connect(
    addr: SocketAddr,
    ca_pem: &str,
    cred: &Cred<'_>,
) -> anyhow::Result<hyper::client::conn::http1::SendRequest<Empty<bytes::Bytes>>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(ca_pem.as_bytes())?)?;
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots);
    let cfg = match cred {
        Cred::Cert(c, k) => cfg.with_client_auth_cert(
            vec![CertificateDer::from_pem_slice(c.as_bytes())?],
            PrivateKeyDer::from_pem_slice(k.as_bytes())?,
        )?,
        _ => cfg.with_no_client_auth(),
    };
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    // The certificate must name the address the apiserver calls.
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from("127.0.0.1")?.to_owned(), tcp)
        .await?;
    let (send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls)).await?;
    tokio::spawn(conn);
    Ok(send)
}

pub fn request(cred: &Cred<'_>, method: &str, path: &str) -> hyper::Request<Empty<bytes::Bytes>> {
    let mut b = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "127.0.0.1");
    if let Cred::Token(t) = cred {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    b.body(Empty::new()).unwrap()
}

impl Env {
    pub async fn call(
        &self,
        cred: Cred<'_>,
        method: &str,
        path: &str,
    ) -> anyhow::Result<(u16, String)> {
        let mut send = connect(self.addr, &self.s.pki.ca_pem, &cred).await?;
        let resp = send.send_request(request(&cred, method, path)).await?;
        let code = resp.status().as_u16();
        let body = tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect())
            .await??
            .to_bytes();
        Ok((code, String::from_utf8_lossy(&body).into_owned()))
    }

    pub async fn get(&self, cred: Cred<'_>, path: &str) -> (u16, String) {
        self.call(cred, "GET", path).await.unwrap()
    }

    pub async fn logs(&self, query: &str) -> (u16, String) {
        self.get(
            Cred::Token(ADMIN_TOKEN),
            &format!("/containerLogs/vehicle/web/app{query}"),
        )
        .await
    }
}
