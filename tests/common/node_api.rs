//! The node API (port 10250) for the tests that run a real edgehub: a client with TLS, the
//! server verified against the cluster CA for 127.0.0.1 as the apiserver connects; and
//! `edgehub run` with `[node] node_api_addr` on, against the fake apiserver and the CRI stack:
//! a node of its own (tests share one containerd) with a token for its own identity, its
//! serving CSR left pending until the test approves it as `kubectl certificate approve`
//! does. Included by `#[path]` beside `mod common;`.
#![allow(dead_code)]

use edgehub_testsupport::{FakeApiServer, ADMIN_TOKEN, KUBELET_SERVING_SIGNER};
use http_body_util::{BodyExt, Empty};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_edgehub");
const CSRS: &str = "/apis/certificates.k8s.io/v1/certificatesigningrequests";

/// A hostNetwork busybox pod named `talker` bound to `node`, its one container `app` running
/// `script` (a log to read): the pod the node API's tests and benches serve.
pub fn talker(node: &str, namespace: &str, uid: &str, script: &str) -> Value {
    json!({
        "metadata": {"name": "talker", "namespace": namespace, "uid": uid, "resourceVersion": "1"},
        "spec": {
            "nodeName": node,
            "hostNetwork": true,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "app", "image": "127.0.0.1:5000/busybox:1.0", "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", script]}]
        },
        "status": {"phase": "Pending"}
    })
}

pub fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// A running `edgehub run`; dropping it stops it and removes its node's sandboxes.
pub struct NodeRun {
    pub child: Child,
    /// What edgehub wrote to stderr.
    pub stderr: PathBuf,
    pub socket: PathBuf,
    pub node: String,
    /// Where the node API listens.
    pub node_api: SocketAddr,
    pub data: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Drop for NodeRun {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        crate::common::remove_node_sandboxes(&self.socket, &self.node);
    }
}

/// Starts `edgehub run` for node `node` with `pods` (bound to it) in the fake. Serving CSRs
/// stay pending, as with the real controller manager, until [`approve`].
pub fn start(s: &FakeApiServer, node: &str, pods: &[Value]) -> NodeRun {
    let socket = crate::common::cri_stack();
    let token = format!("{node}-token");
    s.add_token(&token, &format!("system:node:{node}"));
    s.set_csr_approver(Some(Arc::new(|_: &edgehub_testsupport::CsrRequest| {
        edgehub_testsupport::Approval::Pending
    })));
    let dir = tempfile::tempdir().unwrap();
    let kc = s
        .write_kubeconfig(&dir.path().join("kube"), &token)
        .unwrap();
    let ca = dir.path().join("client-ca.crt");
    std::fs::write(&ca, &s.pki.ca_pem).unwrap();
    let api_addr = free_addr();
    let node_api = free_addr();
    let data = dir.path().join("data");
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "node_name = \"{node}\"\napi_addr = \"{api_addr}\"\ndata_dir = \"{}\"\nkubeconfig = \"{}\"\ncri_socket = \"{}\"\n[sync]\nbackoff_initial_ms = 50\nbackoff_max_secs = 1\n[node]\nnode_api_addr = \"{node_api}\"\nnode_api_client_ca_file = \"{}\"\n",
            data.display(),
            kc.display(),
            socket.display(),
            ca.display()
        ),
    )
    .unwrap();
    for p in pods {
        s.apply("pods", p.clone());
    }
    // Its log, to tell a panic (in a test build a panic ends only its task; the release
    // build aborts on one) from an orderly answer.
    let stderr = dir.path().join("edgehub.stderr");
    let child = Command::new(BIN)
        .arg("--config")
        .arg(&config)
        .arg("run")
        .env_remove("EDGEHUB_NODE_NAME")
        .env_remove("EDGEHUB_API_ADDR")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    NodeRun {
        child,
        stderr,
        socket,
        node: node.to_string(),
        node_api,
        data,
        dir,
    }
}

/// Waits until the Node advertises the node API's port.
pub async fn wait_advertised(s: &FakeApiServer, run: &NodeRun) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let port = s.get("nodes", "", &run.node).and_then(|n| {
            n.pointer("/status/daemonEndpoints/kubeletEndpoint/Port")
                .cloned()
        });
        if port == Some(json!(run.node_api.port())) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the Node's daemonEndpoints: {port:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The node's kubelet-serving CSR, once it was asked for.
pub async fn serving_csr(s: &FakeApiServer) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let found = s
            .csrs()
            .into_iter()
            .find(|c| c["spec"]["signerName"] == KUBELET_SERVING_SIGNER);
        if let Some(c) = found {
            return c;
        }
        assert!(Instant::now() < deadline, "no serving CSR");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What an operator without the controller does: `kubectl certificate approve`.
pub async fn approve(s: &FakeApiServer, csr: &Value) {
    let name = csr["metadata"]["name"].as_str().unwrap();
    let mut approval = csr.clone();
    approval["status"]["conditions"] = json!([{"type": "Approved", "status": "True",
        "reason": "KubectlApprove", "message": "This CSR was approved by kubectl certificate approve."}]);
    let (code, got) = s
        .raw(
            Some(ADMIN_TOKEN),
            "PUT",
            &format!("{CSRS}/{name}/approval"),
            Some("application/json"),
            Some(&approval),
        )
        .await
        .unwrap();
    assert_eq!(code, 200, "{got}");
}

/// Waits until the node API answers `/healthz` with its serving certificate.
pub async fn wait_served(run: &NodeRun, ca_pem: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match get(run.node_api, ca_pem, "/healthz").await {
            Ok(r) => {
                assert_eq!(r, (200, "ok".into()));
                return;
            }
            Err(e) => assert!(Instant::now() < deadline, "never served: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// [`start`], then the serving certificate approved and served.
pub async fn start_served(s: &FakeApiServer, node: &str, pods: &[Value]) -> NodeRun {
    let run = start(s, node, pods);
    wait_advertised(s, &run).await;
    let csr = serving_csr(s).await;
    approve(s, &csr).await;
    wait_served(&run, &s.pki.ca_pem).await;
    run
}

/// A TLS connection to the node API at `addr`, its certificate verified against `ca_pem`.
pub async fn connect(
    addr: SocketAddr,
    ca_pem: &str,
) -> anyhow::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(ca_pem.as_bytes())?)?;
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    Ok(tokio::time::timeout(
        Duration::from_secs(5),
        tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(ServerName::try_from("127.0.0.1")?.to_owned(), tcp),
    )
    .await??)
}

/// GET `path` on the node API with the admin token, the server verified against `ca_pem`
/// for 127.0.0.1.
pub async fn get(addr: SocketAddr, ca_pem: &str, path: &str) -> anyhow::Result<(u16, String)> {
    let tls = connect(addr, ca_pem).await?;
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls)).await?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .uri(path)
        .header("host", "127.0.0.1")
        .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
        .body(Empty::<bytes::Bytes>::new())?;
    let resp = send.send_request(req).await?;
    let code = resp.status().as_u16();
    let body = tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect())
        .await??
        .to_bytes();
    Ok((code, String::from_utf8_lossy(&body).into_owned()))
}

/// The CPU counter (ns) and working set (bytes) containerd reports for `container` of the
/// node's pod `pod`.
pub async fn cri_usage(run: &NodeRun, pod: &str, container: &str) -> (u64, u64) {
    use edgehub::cri::{labels, CriClient};
    let cri = CriClient::new(&run.socket);
    let filter = std::collections::HashMap::from([(labels::NODE.to_string(), run.node.clone())]);
    let stats = cri.list_container_stats(filter).await.unwrap();
    let s = stats
        .iter()
        .find(|s| {
            let label = |k: &str| s.attributes.as_ref().and_then(|a| a.labels.get(k).cloned());
            label(labels::CONTAINER_NAME).as_deref() == Some(container)
                && label(labels::POD_NAME).as_deref() == Some(pod)
        })
        .unwrap_or_else(|| panic!("containerd reports no {pod}/{container}"));
    let cpu = s
        .cpu
        .as_ref()
        .and_then(|c| c.usage_core_nano_seconds.as_ref())
        .map(|v| v.value)
        .expect("containerd reports the CPU");
    let mem = s
        .memory
        .as_ref()
        .and_then(|m| m.working_set_bytes.as_ref())
        .map(|v| v.value)
        .expect("containerd reports the working set");
    (cpu, mem)
}
