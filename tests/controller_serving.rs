//! Serving-certificate approval end to end: `edgehub controller --approve-serving-certs`
//! against the fake apiserver approves the kubelet-serving CSR edgehub's serving task sends
//! for the addresses its Node reports (and the fake's signer issues it), and denies one for
//! an address the Node does not report, with a reason.
#![cfg(feature = "controller")]

mod controller_common;

use base64::Engine;
use controller_common::*;
use edgehub::identity::serving::{Sans, ServingCert};
use edgehub::kube::{ApiClient, ClientOptions, Kubeconfig};
use edgehub_testsupport::certs::{cert_info, serving_csr};
use edgehub_testsupport::{FakeApiServer, KUBELET_SERVING_SIGNER, NODE_TOKEN};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

const CSRS: &str = "/apis/certificates.k8s.io/v1/certificatesigningrequests";

fn node_object() -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "edge-1", "labels": {"kubernetes.io/hostname": "edge-1"}},
        "status": {"addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": "edge-1"}]}})
}

fn condition(c: &Value) -> Option<(String, String)> {
    let c = c.pointer("/status/conditions/0")?;
    Some((
        c["type"].as_str()?.to_string(),
        c["reason"].as_str()?.to_string(),
    ))
}

#[tokio::test]
async fn the_controller_approves_serving_certificates_for_the_nodes_own_addresses() {
    let server = FakeApiServer::start().await.unwrap();
    server.apply("nodes", node_object());
    let dir = tempfile::tempdir().unwrap();
    let kc = admin_kubeconfig(&server, dir.path());
    let ctl = Controller::start(&kc, "replica-a", &["--approve-serving-certs"]);
    wait_until(30, "the controller leads", || ctl.leading()).await;

    // edgehub's serving task, as the node.
    let node_kc = server
        .write_kubeconfig(&dir.path().join("node"), NODE_TOKEN)
        .unwrap();
    let client = ApiClient::new(
        &Kubeconfig::load(&node_kc).unwrap(),
        ClientOptions {
            timeout: Duration::from_secs(5),
            watch_idle_timeout: Duration::from_secs(30),
            max_body: 4 << 20,
            node_name: "edge-1".into(),
        },
    )
    .unwrap();
    let (task, mut rx) = ServingCert::setup(
        client,
        &dir.path().join("data"),
        "edge-1",
        Arc::new(|| Sans {
            dns: vec!["edge-1".into()],
            ips: vec!["127.0.0.1".parse().unwrap()],
        }),
        None,
        false,
    )
    .unwrap();
    let (_stop, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(task.run(stop_rx));
    tokio::time::timeout(Duration::from_secs(30), rx.wait_for(|p| p.is_some()))
        .await
        .expect("the serving certificate, approved by the controller")
        .unwrap();
    let pair = rx.borrow().clone().unwrap();
    let info = cert_info(&pair.cert_pem).unwrap();
    assert!(info.server_auth);
    assert_eq!(info.sans, vec!["edge-1", "127.0.0.1"]);
    let approved: Vec<Value> = server
        .csrs()
        .into_iter()
        .filter(|c| c["spec"]["signerName"] == KUBELET_SERVING_SIGNER)
        .collect();
    assert_eq!(approved.len(), 1);
    assert_eq!(
        condition(&approved[0]),
        Some(("Approved".into(), "NodeAddressesMatch".into()))
    );

    // An address edge-1 does not report: denied, with the reason.
    let (pem, _) = serving_csr(
        "system:node:edge-1",
        &["edge-1"],
        &["8.8.8.8".parse().unwrap()],
    )
    .unwrap();
    let body = json!({"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
        "metadata": {"generateName": "csr-"},
        "spec": {"request": base64::engine::general_purpose::STANDARD.encode(pem),
                 "signerName": KUBELET_SERVING_SIGNER, "usages": ["digital signature", "server auth"]}});
    let (code, got) = server
        .raw(
            Some(NODE_TOKEN),
            "POST",
            CSRS,
            Some("application/json"),
            Some(&body),
        )
        .await
        .unwrap();
    assert_eq!(code, 201, "{got}");
    let name = got["metadata"]["name"].as_str().unwrap().to_string();
    wait_until(30, "the stray address denied", || {
        server
            .get("certificatesigningrequests", "", &name)
            .and_then(|c| condition(&c))
            .is_some()
    })
    .await;
    let c = server.get("certificatesigningrequests", "", &name).unwrap();
    assert_eq!(
        condition(&c),
        Some(("Denied".into(), "AddressesNotTheNodes".into()))
    );
    assert!(
        c["status"]["conditions"][0]["message"]
            .as_str()
            .unwrap()
            .contains("8.8.8.8"),
        "{c}"
    );
    assert!(c.pointer("/status/certificate").is_none());
    assert_deploy_rbac_allows_every_request(&server);
}
