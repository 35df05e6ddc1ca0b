//! `edgehub run` with `[node] node_api_addr`: a real pod in containerd (the stack of
//! scripts/cri-stack.sh), its logs read through the node's API as the apiserver would, after
//! the serving certificate was asked for, held pending (no handshake meanwhile) and approved
//! as `kubectl certificate approve` does; the Node advertises the port. Needs root; without
//! it this fails, loudly.

mod common;
#[path = "common/node_api.rs"]
mod node_api;

use edgehub_testsupport::{FakeApiServer, ADMIN_TOKEN, KUBELET_SERVING_SIGNER};
use http_body_util::{BodyExt, Empty};
use serde_json::json;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_edgehub");
const NS: &str = "nodeapi-test";
const CSRS: &str = "/apis/certificates.k8s.io/v1/certificatesigningrequests";

fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

struct Run {
    child: Child,
    socket: PathBuf,
    node: String,
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        common::remove_node_sandboxes(&self.socket, &self.node);
    }
}

/// GET `path` on the node API with the admin token, the server verified against `ca_pem`
/// for 127.0.0.1.
async fn get(addr: SocketAddr, ca_pem: &str, path: &str) -> anyhow::Result<(u16, String)> {
    let tls = node_api::connect(addr, ca_pem).await?;
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

#[tokio::test]
async fn kubectl_logs_through_the_node_api_of_a_running_edgehub() {
    let socket = common::cri_stack();
    let s = FakeApiServer::start().await.unwrap();
    // A node of its own (tests share one containerd), with a token for its own identity:
    // NodeRestriction lets a node ask only for its own name's certificates.
    let node = format!("edge-nodeapi-{}", std::process::id());
    let token = format!("{node}-token");
    s.add_token(&token, &format!("system:node:{node}"));
    // No approver: serving CSRs stay pending, as with the real controller manager.
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
    s.apply(
        "pods",
        json!({
            "metadata": {"name": "talker", "namespace": NS, "uid": format!("nodeapi-{}", std::process::id()), "resourceVersion": "1"},
            "spec": {
                "nodeName": node,
                "hostNetwork": true,
                "automountServiceAccountToken": false,
                "terminationGracePeriodSeconds": 0,
                "containers": [{"name": "app", "image": "127.0.0.1:5000/busybox:1.0", "imagePullPolicy": "IfNotPresent",
                    "command": ["sh", "-c", "for i in 1 2 3 4 5; do echo \"line $i\"; done; while true; do sleep 0.3; echo tick; done"]}]
            },
            "status": {"phase": "Pending"}
        }),
    );
    let child = Command::new(BIN)
        .arg("--config")
        .arg(&config)
        .arg("run")
        .env_remove("EDGEHUB_NODE_NAME")
        .env_remove("EDGEHUB_API_ADDR")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _run = Run {
        child,
        socket,
        node: node.clone(),
    };

    // The Node advertises the port.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let port = s.get("nodes", "", &node).and_then(|n| {
            n.pointer("/status/daemonEndpoints/kubeletEndpoint/Port")
                .cloned()
        });
        if port == Some(json!(node_api.port())) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the Node's daemonEndpoints: {port:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The serving CSR, pending: no handshake completes meanwhile.
    let deadline = Instant::now() + Duration::from_secs(30);
    let csr = loop {
        let found = s
            .csrs()
            .into_iter()
            .find(|c| c["spec"]["signerName"] == KUBELET_SERVING_SIGNER);
        if let Some(c) = found {
            break c;
        }
        assert!(Instant::now() < deadline, "no serving CSR");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(csr["spec"]["username"], format!("system:node:{node}"));
    assert!(
        get(node_api, &s.pki.ca_pem, "/healthz").await.is_err(),
        "served before a certificate exists"
    );

    // What an operator without the controller does: kubectl certificate approve.
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
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match get(node_api, &s.pki.ca_pem, "/healthz").await {
            Ok(r) => {
                assert_eq!(r, (200, "ok".into()));
                break;
            }
            Err(e) => assert!(Instant::now() < deadline, "never served: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let file = data.join("identity/node-serving.pem");
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // The container's lines, as containerd wrote them, through the node API.
    let logs = format!("/containerLogs/{NS}/talker/app");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (code, body) = get(node_api, &s.pki.ca_pem, &logs).await.unwrap();
        if code == 200 && body.matches("tick\n").count() >= 2 {
            assert!(
                body.starts_with("line 1\nline 2\nline 3\nline 4\nline 5\ntick\n"),
                "{body}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "no logs: {code} {body}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let (code, body) = get(node_api, &s.pki.ca_pem, &format!("{logs}?tailLines=2"))
        .await
        .unwrap();
    assert_eq!((code, body.as_str()), (200, "tick\ntick\n"));
    let (_, body) = get(
        node_api,
        &s.pki.ca_pem,
        &format!("{logs}?timestamps=true&limitBytes=40"),
    )
    .await
    .unwrap();
    assert_eq!(body.len(), 40, "{body}");
    let (ts, rest) = body.split_once(' ').unwrap();
    assert!(edgehub::logs::rfc3339_nanos(ts).is_some(), "{body}");
    assert!(rest.starts_with("line 1\n"), "{body}");
    let (code, _) = get(node_api, &s.pki.ca_pem, &format!("{logs}?previous=true"))
        .await
        .unwrap();
    assert_eq!(code, 400, "no previous attempt yet");

    // Stats: the numbers containerd reports, bracketed by asking it before and after.
    use edgehub::cri::{labels, CriClient};
    let cri = CriClient::new(&_run.socket);
    let filter = std::collections::HashMap::from([(labels::NODE.to_string(), node.clone())]);
    let cpu_of = |stats: &[edgehub::cri::api::ContainerStats]| -> u64 {
        stats
            .iter()
            .find(|s| {
                s.attributes
                    .as_ref()
                    .and_then(|a| a.labels.get(labels::CONTAINER_NAME))
                    == Some(&"app".to_string())
            })
            .and_then(|s| s.cpu.as_ref()?.usage_core_nano_seconds.as_ref())
            .map(|v| v.value)
            .expect("containerd reports app's CPU")
    };
    let before = cpu_of(&cri.list_container_stats(filter.clone()).await.unwrap());
    let (code, text) = get(node_api, &s.pki.ca_pem, "/metrics/resource")
        .await
        .unwrap();
    let after = cpu_of(&cri.list_container_stats(filter.clone()).await.unwrap());
    assert_eq!(code, 200, "{text}");
    let value = |name: &str| -> f64 {
        let prefix = format!("{name}{{container=\"app\",namespace=\"{NS}\",pod=\"talker\"}} ");
        let line = text
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("no {prefix} in:\n{text}"));
        line[prefix.len()..]
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let cpu = value("container_cpu_usage_seconds_total");
    assert!(
        before as f64 / 1e9 - 1e-9 <= cpu && cpu <= after as f64 / 1e9 + 1e-9,
        "{before} <= {cpu} s <= {after}"
    );
    assert!(value("container_memory_working_set_bytes") > 0.0);
    assert!(text.contains("\nnode_cpu_usage_seconds_total "), "{text}");
    assert!(text.contains("\nscrape_error 0\n"), "{text}");
    let before = cpu_of(&cri.list_container_stats(filter.clone()).await.unwrap());
    let (code, body) = get(node_api, &s.pki.ca_pem, "/stats/summary")
        .await
        .unwrap();
    let after = cpu_of(&cri.list_container_stats(filter).await.unwrap());
    assert_eq!(code, 200, "{body}");
    let summary: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(summary["node"]["nodeName"], node.as_str());
    let pod = summary["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["podRef"]["name"] == "talker")
        .unwrap_or_else(|| panic!("no talker in {body}"));
    assert_eq!(pod["podRef"]["namespace"], NS);
    let c = &pod["containers"][0];
    assert_eq!(c["name"], "app");
    let n = c["cpu"]["usageCoreNanoSeconds"].as_u64().unwrap();
    assert!(before <= n && n <= after, "{before} <= {n} <= {after}");
    assert!(c["memory"]["workingSetBytes"].as_u64().unwrap() > 0);
}
