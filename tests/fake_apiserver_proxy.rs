//! The fake apiserver's node proxy and discovery, replayed from the recordings: each
//! `pod_log_*`, `pod_exec_*`, `pod_attach_*`, `pod_portforward_*` and `node_proxy_*` fixture's
//! request gets the recorded answer, and what reaches the kubelet is what the real apiserver
//! sent (method, path, query). The kubelet here is a listener that records requests, as the
//! one the fixtures were recorded with: it answers logs with two lines, a path with `ghost`
//! with a 404, and an upgrade with a 101, then echoes what it reads.

use edgehub_testsupport::certs::cert_info;
use edgehub_testsupport::{fixture, FakeApiServer, ADMIN_TOKEN, NODE_TOKEN};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const AGENT_TOKEN: &str = "edge-agent-token";

/// One request the kubelet saw.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    query: BTreeMap<String, Vec<String>>,
    headers: BTreeMap<String, String>,
    /// The client certificate's subject, if one was presented.
    client: Option<String>,
}

type Log = Arc<Mutex<Vec<Seen>>>;

fn decode(s: &str) -> String {
    percent_encoding::percent_decode_str(&s.replace('+', " "))
        .decode_utf8_lossy()
        .into_owned()
}

async fn serve_one(
    tls: tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
    log: Log,
) -> std::io::Result<()> {
    let client = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| {
            let pem = format!(
                "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
                base64_encode(c.as_ref())
            );
            cert_info(&pem).map(|i| i.subject).unwrap_or_default()
        });
    let mut tls = tls;
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        if tls.read(&mut b).await? == 0 {
            return Ok(());
        }
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let mut lines = head.split("\r\n");
    let first: Vec<&str> = lines.next().unwrap_or("").split(' ').collect();
    let (path, q) = first[1].split_once('?').unwrap_or((first[1], ""));
    let mut query: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for p in q.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = p.split_once('=').unwrap_or((p, ""));
        query.entry(decode(k)).or_default().push(decode(v));
    }
    let headers: BTreeMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let upgrade = headers.contains_key("upgrade");
    log.lock().unwrap().push(Seen {
        method: first[0].to_string(),
        path: path.to_string(),
        query,
        headers,
        client,
    });
    if path == "/metrics/resource" {
        // Counters that grow at 250 millicores (the container) and 500 (the node).
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        let (secs, ms) = (now.as_secs_f64() - 1.7e9, now.as_millis());
        let body = format!(
            "# TYPE container_cpu_usage_seconds_total counter\n\
             container_cpu_usage_seconds_total{{container=\"app\",namespace=\"default\",pod=\"web\"}} {} {ms}\n\
             container_memory_working_set_bytes{{container=\"app\",namespace=\"default\",pod=\"web\"}} 4194304 {ms}\n\
             container_cpu_usage_seconds_total{{container=\"app\",namespace=\"default\",pod=\"gone\"}} 1 {ms}\n\
             node_cpu_usage_seconds_total {} {ms}\nnode_memory_working_set_bytes 1073741824 {ms}\nscrape_error 0\n",
            secs * 0.25,
            secs * 0.5
        );
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        tls.write_all(resp.as_bytes()).await?;
    } else if path.contains("/ghost") {
        let body = "pod default/ghost not found on this node\n";
        let resp = format!("HTTP/1.1 404 Not Found\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\n\r\n{body}", body.len());
        tls.write_all(resp.as_bytes()).await?;
    } else if upgrade {
        tls.write_all(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\n\r\n").await?;
        let mut buf = [0u8; 1024];
        loop {
            let n = tls.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            tls.write_all(&buf[..n]).await?;
        }
    } else {
        let body = "line one\nline two\n";
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        tls.write_all(resp.as_bytes()).await?;
    }
    tls.shutdown().await
}

fn base64_encode(der: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(der)
}

/// Starts the recording kubelet on 127.0.0.1 with the fake's server certificate; returns its
/// port and its log.
async fn recording_kubelet(s: &FakeApiServer) -> (u16, Log) {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(s.pki.ca_pem.as_bytes()).unwrap())
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .allow_unauthenticated()
    .build()
    .unwrap();
    let cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            vec![CertificateDer::from_pem_slice(s.pki.server_cert_pem.as_bytes()).unwrap()],
            PrivateKeyDer::from_pem_slice(s.pki.server_key_pem.as_bytes()).unwrap(),
        )
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let log: Log = Arc::default();
    let l = log.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, l) = (acceptor.clone(), l.clone());
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(tcp).await {
                    let _ = serve_one(tls, l).await;
                }
            });
        }
    });
    (port, log)
}

fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn node(name: &str, port: u16, addresses: Value) -> Value {
    json!({"metadata": {"name": name}, "status": {"addresses": addresses,
        "daemonEndpoints": {"kubeletEndpoint": {"Port": port}}}})
}

fn pod(name: &str, node: &str, containers: &[&str]) -> Value {
    let cs: Vec<Value> = containers
        .iter()
        .map(|c| json!({"name": c, "image": "busybox"}))
        .collect();
    json!({"metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
        "spec": {"nodeName": node, "containers": cs}})
}

/// The recorded cluster: edge-1 (the recording kubelet), edge-2 (a closed port), edge-3
/// (InternalIP and Hostname), and the pods the fixtures name.
async fn cluster() -> (FakeApiServer, Log) {
    let s = FakeApiServer::start().await.unwrap();
    s.add_token(AGENT_TOKEN, "edge-agent");
    let (port, log) = recording_kubelet(&s).await;
    let ip = json!([{"type": "InternalIP", "address": "127.0.0.1"}]);
    s.apply("nodes", node("edge-1", port, ip.clone()));
    s.apply("nodes", node("edge-2", closed_port(), ip));
    s.apply(
        "nodes",
        node(
            "edge-3",
            port,
            json!([{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": "edge-3"}]),
        ),
    );
    for p in [
        pod("web", "edge-1", &["app"]),
        pod("duo", "edge-1", &["app", "side"]),
        pod("far", "edge-2", &["app"]),
        pod("host", "edge-3", &["app"]),
        pod("ghost", "edge-1", &["app"]),
    ] {
        s.apply("pods", p);
    }
    (s, log)
}

fn token_for(identity: &str) -> &'static str {
    match identity {
        "admin" => ADMIN_TOKEN,
        "system:node:edge-1" => NODE_TOKEN,
        _ => AGENT_TOKEN,
    }
}

/// Replays fixture `name`; returns what came back and what the kubelet saw meanwhile.
async fn replay(
    s: &FakeApiServer,
    log: &Log,
    name: &str,
) -> (edgehub_testsupport::RawAnswer, Vec<Seen>) {
    let f = fixture(name);
    let req = &f["request"];
    let headers: Vec<(String, String)> = req["headers"]
        .as_object()
        .map(|h| {
            h.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
                .collect()
        })
        .unwrap_or_default();
    let headers: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let before = log.lock().unwrap().len();
    let got = s
        .raw_any(
            Some(token_for(f["identity"].as_str().unwrap())),
            req["method"].as_str().unwrap(),
            req["path"].as_str().unwrap(),
            &headers,
            Duration::from_secs(2),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let seen = log.lock().unwrap()[before..].to_vec();
    (got, seen)
}

/// Same status and body (a Status compared whole; text as text), and the same request at
/// the kubelet, or none when none was recorded.
fn assert_as_recorded(name: &str, got: &edgehub_testsupport::RawAnswer, seen: &[Seen]) {
    let f = fixture(name);
    let want = &f["response"];
    assert_eq!(
        got.status,
        want["status"].as_u64().unwrap() as u16,
        "{name}: {}",
        got.text()
    );
    match &want["body"] {
        Value::String(text) => assert_eq!(&got.text(), text, "{name}"),
        Value::Null => assert!(got.body.is_empty(), "{name}"),
        body => assert_eq!(&got.json(), body, "{name}"),
    }
    let k = &f["kubelet_request"];
    if k.is_null() {
        assert!(seen.is_empty(), "{name}: reached the kubelet: {seen:?}");
        return;
    }
    assert_eq!(seen.len(), 1, "{name}: {seen:?}");
    assert_eq!(seen[0].method, k["method"], "{name}");
    assert_eq!(seen[0].path, k["path"], "{name}");
    let q: BTreeMap<String, Vec<String>> = serde_json::from_value(k["query"].clone()).unwrap();
    assert_eq!(seen[0].query, q, "{name}");
    if let Some(h) = k["headers"].as_object() {
        for key in ["Upgrade", "Connection", "X-Stream-Protocol-Version"] {
            if let Some(v) = h.get(key) {
                assert_eq!(
                    seen[0]
                        .headers
                        .get(&key.to_ascii_lowercase())
                        .map(String::as_str),
                    v[0].as_str(),
                    "{name}: {key}"
                );
            }
        }
    }
}

/// Replays each fixture and checks it is answered and forwarded as recorded.
async fn replay_all(s: &FakeApiServer, log: &Log, names: &[&str]) {
    for name in names {
        let (got, seen) = replay(s, log, name).await;
        assert_as_recorded(name, &got, &seen);
    }
}

/// A GET as `token`: the status code and the JSON body.
async fn get(s: &FakeApiServer, token: &str, path: &str) -> (u16, Value) {
    s.raw(Some(token), "GET", path, None, None).await.unwrap()
}

#[tokio::test]
async fn logs_answer_and_forward_as_recorded() {
    let (s, log) = cluster().await;
    replay_all(
        &s,
        &log,
        &[
            "pod_log_proxied_to_kubelet",
            "pod_log_since_time_default_container",
            "pod_log_two_containers_no_container_bad_request",
            "pod_log_unknown_container_bad_request",
            "pod_log_both_since_invalid",
            "pod_log_not_found",
            "pod_log_forbidden_as_node",
            "pod_log_forbidden_no_rbac",
            "pod_log_kubelet_404",
        ],
    )
    .await;
    // The apiserver presents its kubelet-client certificate, issued from the client CA.
    let seen = log.lock().unwrap()[0].clone();
    assert_eq!(
        seen.client
            .as_deref()
            .map(|s| s.contains("CN=kube-apiserver-kubelet-client")),
        Some(true),
        "{seen:?}"
    );
    assert!(!seen.headers.contains_key("authorization"), "{seen:?}");
    // A closed kubelet port: the same Status, for the fake's own port.
    let (got, seen) = replay(&s, &log, "pod_log_kubelet_unreachable").await;
    assert!(seen.is_empty());
    let want = fixture("pod_log_kubelet_unreachable")["response"]["body"].clone();
    let got = got.json();
    let port = s.get("nodes", "", "edge-2").unwrap()["status"]["daemonEndpoints"]
        ["kubeletEndpoint"]["Port"]
        .clone();
    assert_eq!(
        got["message"],
        format!("Get \"https://127.0.0.1:{port}/containerLogs/default/far/app\": dial tcp 127.0.0.1:{port}: connect: connection refused")
    );
    assert_eq!(
        got.as_object().unwrap().keys().collect::<Vec<_>>(),
        want.as_object().unwrap().keys().collect::<Vec<_>>()
    );
    assert_eq!(got["code"], want["code"]);
    // Deviation, on purpose: the real apiserver of the recording kept its default
    // --kubelet-preferred-address-types (Hostname first) and dialed "edge-3"; the fake uses
    // kubeadm's (InternalIP first), which is what makes an edgehub Node reachable.
    let (got, seen) = replay(&s, &log, "pod_log_hostname_preferred").await;
    assert_eq!((got.status, seen.len()), (200, 1), "{}", got.text());
}

#[tokio::test]
async fn streams_upgrade_and_forward_as_recorded() {
    let (s, log) = cluster().await;
    replay_all(
        &s,
        &log,
        &[
            "pod_exec_forbidden_as_node",
            "pod_exec_forbidden_no_rbac",
            "pod_exec_without_upgrade_bad_request",
            "pod_exec_kubelet_404",
            "pod_exec_no_command_forwarded",
            "pod_attach_proxied_to_kubelet",
            "pod_portforward_proxied_to_kubelet",
        ],
    )
    .await;
    // The 101 is relayed with the kubelet's headers, and bytes go through both ways.
    let (got, seen) = replay(&s, &log, "pod_exec_proxied_to_kubelet").await;
    assert_as_recorded("pod_exec_proxied_to_kubelet", &got, &seen);
    let want = &fixture("pod_exec_proxied_to_kubelet")["response"]["headers"];
    for (k, v) in want.as_object().unwrap() {
        assert_eq!(
            got.headers.get(k).and_then(|h| h.to_str().ok()),
            v.as_str(),
            "{k}"
        );
    }
    let mut io = got.upgraded.unwrap();
    io.write_all(b"ping through the splice").await.unwrap();
    let mut buf = [0u8; 23];
    tokio::time::timeout(Duration::from_secs(5), io.read_exact(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&buf, b"ping through the splice");
}

#[tokio::test]
async fn node_proxy_answers_as_recorded() {
    let (s, log) = cluster().await;
    replay_all(
        &s,
        &log,
        &[
            "node_proxy_forbidden_no_rbac",
            "node_proxy_loopback_not_allowed",
        ],
    )
    .await;
    // Test-only: a loopback kubelet reached anyway, path and query as sent.
    s.set_test_only_loopback_node_proxy(true);
    let (got, seen) = replay(&s, &log, "node_proxy_loopback_not_allowed").await;
    assert_eq!(got.status, 200, "{}", got.text());
    assert_eq!(seen.len(), 1);
    assert_eq!(
        (seen[0].method.as_str(), seen[0].path.as_str()),
        ("GET", "/healthz")
    );
    assert_eq!(seen[0].query.get("x"), Some(&vec!["1".to_string()]));
    // A user granted the node proxy by RBAC gets through; without it, the recorded 403.
    s.grant_kubelet_proxy("edge-agent");
    let (got, _) = replay(&s, &log, "node_proxy_forbidden_no_rbac").await;
    assert_eq!(got.status, 200, "{}", got.text());
}

#[tokio::test]
async fn discovery_is_the_recorded_documents_cut_to_what_the_fake_serves() {
    let (s, _log) = cluster().await;
    for (name, path) in [
        ("discovery_api", "/api"),
        ("discovery_apis", "/apis"),
        ("discovery_api_v1", "/api/v1"),
        ("discovery_apis_apps_v1", "/apis/apps/v1"),
        (
            "discovery_apis_coordination_v1",
            "/apis/coordination.k8s.io/v1",
        ),
        (
            "discovery_apis_certificates_v1",
            "/apis/certificates.k8s.io/v1",
        ),
        (
            "discovery_apis_authentication_v1",
            "/apis/authentication.k8s.io/v1",
        ),
        (
            "discovery_apis_authorization_v1",
            "/apis/authorization.k8s.io/v1",
        ),
    ] {
        let (code, got) = get(&s, ADMIN_TOKEN, path).await;
        let want = fixture(name)["response"]["body"].clone();
        assert_eq!(code, 200, "{path}");
        assert_eq!(got["kind"], want["kind"], "{path}");
        // Every entry the fake lists is the recorded one, field for field.
        let (list, key) = match want["kind"].as_str().unwrap() {
            "APIResourceList" => ("resources", "name"),
            "APIGroupList" => ("groups", "name"),
            _ => ("versions", ""),
        };
        for item in got[list].as_array().unwrap() {
            if key.is_empty() || item[key] == "metrics.k8s.io" {
                continue;
            }
            let recorded = want[list]
                .as_array()
                .unwrap()
                .iter()
                .find(|w| w[key] == item[key]);
            assert_eq!(Some(item), recorded, "{path}: {}", item[key]);
        }
    }
    // kubectl's resource names map to what the fake serves.
    let (_, core) = get(&s, ADMIN_TOKEN, "/api/v1").await;
    let names: Vec<&str> = core["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    for n in ["pods", "pods/log", "pods/exec", "nodes", "nodes/proxy"] {
        assert!(names.contains(&n), "{n} in {names:?}");
    }
    assert!(!names.contains(&"services"), "{names:?}");
    let (code, m) = get(&s, ADMIN_TOKEN, "/apis/metrics.k8s.io/v1beta1").await;
    assert_eq!(code, 200);
    assert_eq!(m["groupVersion"], "metrics.k8s.io/v1beta1");
    // Discovery needs a user, as with --anonymous-auth=false.
    let (code, _) = s.raw(None, "GET", "/api", None, None).await.unwrap();
    assert_eq!(code, 401);
}

/// metrics.k8s.io from the kubelets' `/metrics/resource`, as metrics-server computes it: the
/// counters' rate over the window between two scrapes, the working set as it is.
#[tokio::test]
async fn metrics_are_rates_between_two_scrapes() {
    let (s, log) = cluster().await;
    // Only edge-1 has a kubelet that answers; edge-2's port is closed, edge-3 shares edge-1's.
    s.remove("nodes", "", "edge-3");
    let (code, nodes) = get(&s, ADMIN_TOKEN, "/apis/metrics.k8s.io/v1beta1/nodes").await;
    assert_eq!(code, 200, "{nodes}");
    assert_eq!(nodes["kind"], "NodeMetricsList");
    assert_eq!(nodes["apiVersion"], "metrics.k8s.io/v1beta1");
    let items = nodes["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{nodes}");
    let n = &items[0];
    assert_eq!(n["metadata"]["name"], "edge-1");
    assert_eq!(n["usage"]["memory"], "1Gi");
    let cpu = n["usage"]["cpu"].as_str().unwrap();
    let nanocores: f64 = cpu.trim_end_matches('n').parse().unwrap();
    assert!((nanocores - 5e8).abs() < 5e7, "{cpu}");
    let window = n["window"].as_str().unwrap();
    assert!(window.ends_with('s') && window.starts_with('1'), "{window}");
    // Two scrapes of edge-1, a resolution apart; pods come from the same two.
    let scrapes = log
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r.path == "/metrics/resource")
        .count();
    assert_eq!(scrapes, 2);
    let (code, pods) = get(
        &s,
        ADMIN_TOKEN,
        "/apis/metrics.k8s.io/v1beta1/namespaces/default/pods",
    )
    .await;
    assert_eq!(code, 200, "{pods}");
    let items = pods["items"].as_array().unwrap();
    // `gone` is not a pod the apiserver knows: left out, as metrics-server does.
    assert_eq!(items.len(), 1, "{pods}");
    let p = &items[0];
    assert_eq!(p["kind"], "PodMetrics");
    assert_eq!(
        (
            p["metadata"]["name"].as_str(),
            p["metadata"]["namespace"].as_str()
        ),
        (Some("web"), Some("default"))
    );
    assert_eq!(p["containers"][0]["name"], "app");
    assert_eq!(p["containers"][0]["usage"]["memory"], "4Mi");
    let cpu = p["containers"][0]["usage"]["cpu"].as_str().unwrap();
    let nanocores: f64 = cpu.trim_end_matches('n').parse().unwrap();
    assert!((nanocores - 2.5e8).abs() < 2.5e7, "{cpu}");
    let (code, one) = get(
        &s,
        ADMIN_TOKEN,
        "/apis/metrics.k8s.io/v1beta1/namespaces/default/pods/web",
    )
    .await;
    assert_eq!((code, &one["metadata"]["name"]), (200, &json!("web")));
    let (code, _) = get(&s, ADMIN_TOKEN, "/apis/metrics.k8s.io/v1beta1/nodes/edge-2").await;
    assert_eq!(code, 404);
    // RBAC: metrics are for users allowed them.
    let (code, got) = get(&s, AGENT_TOKEN, "/apis/metrics.k8s.io/v1beta1/nodes").await;
    assert_eq!(code, 403, "{got}");
    assert_eq!(
        got["message"],
        "nodes.metrics.k8s.io is forbidden: User \"edge-agent\" cannot list resource \"nodes\" in API group \"metrics.k8s.io\" at the cluster scope"
    );
}
