//! `edgehub run` with `[node] node_api_addr`: a real pod in containerd (the stack of
//! scripts/cri-stack.sh), its logs read through the node's API as the apiserver would, after
//! the serving certificate was asked for, held pending (no handshake meanwhile) and approved
//! as `kubectl certificate approve` does; the Node advertises the port. Needs root; without
//! it this fails, loudly.

mod common;
#[path = "common/node_api.rs"]
mod node_api;

use node_api::get;
use serde_json::json;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

const NS: &str = "nodeapi-test";

#[tokio::test]
async fn kubectl_logs_through_the_node_api_of_a_running_edgehub() {
    let s = edgehub_testsupport::FakeApiServer::start().await.unwrap();
    let node = format!("edge-nodeapi-{}", std::process::id());
    let talker = json!({
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
    });
    let run = node_api::start(&s, &node, &[talker]);
    let data = run.data.clone();
    let node_api = run.node_api;

    // The Node advertises the port.
    node_api::wait_advertised(&s, &run).await;
    // The serving CSR, pending: no handshake completes meanwhile.
    let csr = node_api::serving_csr(&s).await;
    assert_eq!(csr["spec"]["username"], format!("system:node:{node}"));
    assert!(
        get(node_api, &s.pki.ca_pem, "/healthz").await.is_err(),
        "served before a certificate exists"
    );

    // What an operator without the controller does: kubectl certificate approve.
    node_api::approve(&s, &csr).await;
    node_api::wait_served(&run, &s.pki.ca_pem).await;
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
    let cri = CriClient::new(&run.socket);
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
