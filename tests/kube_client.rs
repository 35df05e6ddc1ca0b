//! The apiserver client's errors stay clear: bad credentials, missing RBAC, an untrusted
//! server, an unreachable one, a missing kubeconfig, oversized events.

mod common;

use common::{client, test_config};
use edgehub::kube::resource::{DAEMONSETS, NODES, PODS};
use edgehub::kube::{KubeError, Kubeconfig, KubeconfigError, ListParams, PatchType, WatchEvent};
use edgehub_testsupport::{certs, FakeApiServer, NODE_TOKEN};
use serde_json::json;

async fn setup(token: &str) -> (FakeApiServer, tempfile::TempDir, edgehub::kube::ApiClient) {
    let server = FakeApiServer::start().await.unwrap();
    server.seed_recorded_cluster();
    let dir = tempfile::tempdir().unwrap();
    let kc = server
        .write_kubeconfig(&dir.path().join("kube"), token)
        .unwrap();
    let c = client(&test_config(&dir.path().join("data"), &kc));
    (server, dir, c)
}

#[tokio::test]
async fn bad_token_is_401_and_points_at_credentials() {
    let (_s, _d, c) = setup("wrong-token").await;
    let e = c
        .list(&PODS, None, &ListParams::default(), None, None)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(401));
    assert!(!e.is_offline());
    let m = e.to_string();
    assert!(m.contains("list pods: 401 Unauthorized"), "{m}");
    assert!(m.contains("credentials"), "{m}");
}

#[tokio::test]
async fn missing_rbac_is_403_naming_the_permission_and_rbac_yaml() {
    let (s, _d, c) = setup(NODE_TOKEN).await;
    s.set_rbac_edgehub(false);
    let e = c
        .list(&DAEMONSETS, None, &ListParams::default(), None, None)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(403));
    let m = e.to_string();
    assert!(m.contains("permission to list daemonsets.apps"), "{m}");
    assert!(m.contains("deploy/rbac.yaml"), "{m}");
    assert!(m.contains("system:node:edge-1"), "{m}");
}

#[tokio::test]
async fn a_server_that_fails_verification_is_refused() {
    let s = FakeApiServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kc = s.write_kubeconfig(dir.path(), NODE_TOKEN).unwrap();
    // Trust some other CA instead of the server's.
    std::fs::write(
        dir.path().join("ca.crt"),
        certs::unrelated_ca_pem().unwrap(),
    )
    .unwrap();
    let c = client(&test_config(&dir.path().join("data"), &kc));
    let e = c
        .list(&PODS, None, &ListParams::default(), None, None)
        .await
        .unwrap_err();
    assert!(matches!(e, KubeError::Tls { .. }), "{e}");
    assert!(!e.is_offline());
    assert!(e.to_string().contains("certificate-authority"), "{e}");
    assert!(
        e.to_string().contains("unknown CA"),
        "names what failed: {e}"
    );
    assert_eq!(s.requests().len(), 0, "no request got through");
}

#[tokio::test]
async fn a_server_that_does_not_speak_tls_is_named() {
    // A plain HTTP server where the kubeconfig says https: what an apiserver's insecure port,
    // or a proxy's, answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut tcp, _)) = listener.accept().await {
            let mut buf = [0u8; 1024];
            let _ = tcp.read(&mut buf).await;
            let _ = tcp
                .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                .await;
        }
    });
    let s = FakeApiServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kc = s.write_kubeconfig(dir.path(), NODE_TOKEN).unwrap();
    let text = std::fs::read_to_string(&kc)
        .unwrap()
        .replace(&s.url(), &format!("https://{addr}"));
    std::fs::write(&kc, text).unwrap();
    let c = client(&test_config(&dir.path().join("data"), &kc));
    let e = c.get(&NODES, None, "edge-1").await.unwrap_err();
    assert!(matches!(e, KubeError::Tls { .. }), "{e}");
    assert!(e.to_string().contains("does not speak TLS"), "{e}");
}

#[tokio::test]
async fn refused_connections_and_unknown_hosts_are_offline_not_fatal() {
    let (s, d, c) = setup(NODE_TOKEN).await;
    s.set_offline(true).await.unwrap();
    let e = c
        .list(&PODS, None, &ListParams::default(), None, None)
        .await
        .unwrap_err();
    assert!(e.is_offline(), "{e}");
    assert!(matches!(e, KubeError::Unreachable { .. }), "{e}");

    // DNS failure: a name under the reserved .invalid TLD never resolves.
    let kc_path = d.path().join("kube/kubeconfig");
    let text = std::fs::read_to_string(&kc_path)
        .unwrap()
        .replace(&s.url(), "https://apiserver.invalid:6443");
    std::fs::write(&kc_path, text).unwrap();
    let c = client(&test_config(&d.path().join("data"), &kc_path));
    let e = c
        .list(&PODS, None, &ListParams::default(), None, None)
        .await
        .unwrap_err();
    assert!(e.is_offline(), "{e}");
    assert!(e.to_string().contains("apiserver.invalid"), "{e}");
}

#[tokio::test]
async fn missing_kubeconfig_is_clear() {
    let e = Kubeconfig::load(std::path::Path::new("/nonexistent/kubeconfig")).unwrap_err();
    assert!(matches!(e, KubeconfigError::Missing { .. }));
    assert!(
        e.to_string()
            .contains("kubeconfig /nonexistent/kubeconfig not found"),
        "{e}"
    );
}

#[tokio::test]
async fn typed_requests_round_trip() {
    let (s, _d, c) = setup(NODE_TOKEN).await;
    let pod = c
        .get(&PODS, Some("vehicle"), "telemetry-sv74m")
        .await
        .unwrap();
    let pod: serde_json::Value = serde_json::from_str(&pod).unwrap();
    let uid = pod["metadata"]["uid"].as_str().unwrap().to_string();

    // A pod that is not bound to the node is 403, not 404 (Node authorizer).
    let e = c
        .get(&PODS, Some("vehicle"), "does-not-exist")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(403));

    let patch = json!({"status": {"conditions": [{"type": "PodNeedUpgrade", "status": "True", "message": "controllerrevision: abc"}]}});
    let out = c
        .patch(
            &PODS,
            Some("vehicle"),
            "telemetry-sv74m",
            Some("status"),
            PatchType::StrategicMerge,
            patch.to_string().into_bytes(),
        )
        .await
        .unwrap();
    let out: serde_json::Value = serde_json::from_str(&out).unwrap();
    let types: Vec<_> = out["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["type"].as_str().unwrap())
        .collect();
    assert!(
        types.contains(&"PodNeedUpgrade") && types.contains(&"PodScheduled"),
        "{types:?}"
    );

    let e = c
        .delete(
            &PODS,
            Some("vehicle"),
            "telemetry-sv74m",
            Some("00000000-0000-0000-0000-000000000000"),
            Some(0),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(409));
    c.delete(
        &PODS,
        Some("vehicle"),
        "telemetry-sv74m",
        Some(&uid),
        Some(0),
    )
    .await
    .unwrap();
    assert!(s.get("pods", "vehicle", "telemetry-sv74m").is_none());

    let ev = json!({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "x.1", "namespace": "vehicle"}, "reason": "UpgradeSucceeded"});
    let created = c
        .create(
            &edgehub::kube::resource::EVENTS,
            Some("vehicle"),
            ev.to_string().into_bytes(),
        )
        .await
        .unwrap();
    assert!(created.contains("\"kind\":\"Event\""));
}

#[tokio::test]
async fn oversized_watch_events_are_dropped_and_the_stream_continues() {
    let (s, d, _) = setup(NODE_TOKEN).await;
    let mut cfg = test_config(&d.path().join("data"), &d.path().join("kube/kubeconfig"));
    cfg.sync.max_event_bytes = 64 << 10;
    let c = client(&cfg);
    let rv = s.resource_version().to_string();
    let params = ListParams {
        field_selector: Some("spec.nodeName=edge-1".into()),
        label_selector: None,
    };
    let mut w = c.watch(&PODS, None, &params, &rv, 30).await.unwrap();
    s.modify("pods", "vehicle", "telemetry-sv74m", |p| {
        p["metadata"]["annotations"]["big"] = json!("x".repeat(100 << 10));
    });
    s.modify("pods", "vehicle", "gateway-v9hb2", |p| {
        p["metadata"]["annotations"]["small"] = json!("y");
    });
    match w.next().await.unwrap().unwrap() {
        WatchEvent::Malformed { reason } => {
            assert!(reason.contains("over the size cap"), "{reason}")
        }
        other => panic!("expected the oversized event to be dropped, got {other:?}"),
    }
    match w.next().await.unwrap().unwrap() {
        WatchEvent::Modified(raw) => assert!(raw.contains("gateway-v9hb2")),
        other => panic!("{other:?}"),
    }
}
