//! The node's identity at full scale: the `edgehub run` binary, the fake apiserver (its CSR API
//! signing with its CA, short certificates through its test-only window) and the shared real
//! containerd. First boot with only a bootstrap kubeconfig, rotations under load, a certificate
//! that expired offline, both credentials lapsed and a token handed over, TLS failures in the
//! status, and a device clock behind the certificate's notBefore. Needs root and the CRI
//! stack; without them these tests fail, loudly.

mod common;
#[path = "common/edge.rs"]
mod edge;

use edge::Node;
use edgehub_testsupport::{BootstrapToken, FakeApiServer, TestOnlyCertWindow};
use serde_json::Value;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A node whose only credential is a bootstrap kubeconfig with `token`: the static node token
/// `edge::node` made is removed from the fake, so nothing but the node's own certificate can
/// act as the node.
async fn identity_node(tag: &str, token: &BootstrapToken, window_secs: Option<u64>) -> Node {
    let n = edge::node(tag).await;
    n.server.remove_token(&format!("token-{}", n.name));
    n.server.add_bootstrap_token(token.clone());
    if let Some(s) = window_secs {
        n.server
            .set_test_only_certificate_window(Some(TestOnlyCertWindow {
                backdate: Duration::from_secs(1),
                valid_for: Duration::from_secs(s),
            }));
    }
    let boot = n
        .server
        .write_kubeconfig(&n.dir.path().join("boot"), &token.bearer())
        .unwrap();
    n.edit_config(|s| {
        format!(
            "{s}[identity]\nbootstrap_kubeconfig = \"{}\"\n",
            boot.display()
        )
    });
    n
}

fn status(n: &Node) -> Value {
    let (code, body) = n.http("GET", "/v1/status");
    if code != 200 {
        return Value::Null;
    }
    serde_json::from_str(&body).unwrap_or(Value::Null)
}

fn identity(n: &Node) -> Value {
    status(n)["identity"].clone()
}

/// One request with a body to the local API.
fn http_body(n: &Node, method: &str, path: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    // The bootstrap token's route is privileged: root on the socket.
    let mut s = std::os::unix::net::UnixStream::connect(n.socket()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let code = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, out.split("\r\n\r\n").nth(1).unwrap_or("").to_string())
}

/// The CSRs the fake holds that `user` made.
fn csrs_by(server: &FakeApiServer, user: &str) -> usize {
    server
        .csrs()
        .iter()
        .filter(|c| c["spec"]["username"] == user)
        .count()
}

async fn pod_runs(n: &Node) {
    n.wait_for(90, "the pod runs", |n| async move {
        n.running("app").await.len() == 1 && n.running("sidecar").await.len() == 1
    })
    .await;
}

async fn node_certificate(n: &Node) {
    n.wait_for(30, "a node certificate in use", |n| async move {
        identity(n)["inUse"] == "nodeCertificate" && identity(n)["lapsed"] == serde_json::json!([])
    })
    .await;
}

fn cli(n: &Node, args: &[&str]) -> (bool, String) {
    let out = n.cmd(args).output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_boot_registers_under_its_own_name_and_the_key_stays_on_the_device() {
    let token = BootstrapToken::new("first1", "0123456789abcdef");
    let mut n = identity_node("idfirst", &token, None).await;
    n.start();
    pod_runs(&n).await;
    n.wait_for(30, "the Node registered", |n| async move {
        n.server.get("nodes", "", &n.name).is_some()
    })
    .await;
    node_certificate(&n).await;

    let me = format!("system:node:{}", n.name);
    let reqs = n.server.requests();
    assert!(
        reqs.iter().any(|r| r.verb == "create"
            && r.resource == "nodes"
            && r.status == 201
            && r.user.as_deref() == Some(me.as_str())),
        "the node registered itself, with its own certificate"
    );
    // The bootstrap token did one thing: the CSR.
    for r in reqs
        .iter()
        .filter(|r| r.user.as_deref() == Some("system:bootstrap:first1"))
    {
        assert_eq!(r.resource, "certificatesigningrequests", "{r:?}");
    }
    assert_eq!(csrs_by(&n.server, "system:bootstrap:first1"), 1);
    let id = identity(&n);
    assert_eq!(id["nodeCertificate"]["subject"], me.as_str());

    // The key: 0600 in the data dir, and nowhere on the fake.
    let path = edgehub::identity::files::credential_path(&n.dir.path().join("data"));
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let text = std::fs::read_to_string(&path).unwrap();
    let key_at = text.find("-----BEGIN PRIVATE KEY-----").unwrap();
    let key_line = text[key_at..].lines().nth(1).unwrap().to_string();
    assert!(key_line.len() > 40);
    let mut seen = String::new();
    for plural in ["certificatesigningrequests", "nodes", "events", "pods"] {
        for o in n.server.list(plural) {
            seen.push_str(&o.to_string());
        }
    }
    assert!(!seen.contains("PRIVATE"));
    assert!(!seen.contains(&key_line), "the key reached the apiserver");
    n.clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_rotations_while_pods_run_and_an_upgrade_is_reported_without_a_relist_or_a_401() {
    let token = BootstrapToken::new("rotat1", "0123456789abcdef");
    let mut n = identity_node("idrot", &token, Some(8)).await;
    n.server.set_bookmark_interval(Duration::from_millis(500));
    n.start();
    pod_runs(&n).await;
    node_certificate(&n).await;
    let lists = |s: &FakeApiServer| {
        ["pods", "daemonsets", "controllerrevisions", "nodes"].map(|p| s.count(|r| r.is_list_of(p)))
    };
    let before = lists(&n.server);
    let me = format!("system:node:{}", n.name);

    n.roll();
    n.wait_for(30, "PodNeedUpgrade True", |n| async move {
        n.need().is_some_and(|c| c["status"] == "True")
    })
    .await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let done = n.wait_state(90, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(done["state"], "Done", "{done}");
    n.wait_for(60, "two rotations", |n| {
        let me = me.clone();
        async move { csrs_by(&n.server, &me) >= 2 }
    })
    .await;
    n.wait_for(60, "the upgrade reported", |n| async move {
        let s = status(n);
        s["outbox"]["queued"] == 0
            // The upgrade's last report: the pod object deleted, for the DaemonSet
            // controller to make its replacement at the new revision.
            && n.server.get("pods", "vehicle", "telemetry-sv74m").is_none()
    })
    .await;

    let reqs = n.server.requests();
    let refused: Vec<_> = reqs.iter().filter(|r| r.status == 401).collect();
    assert!(refused.is_empty(), "{refused:?}");
    assert_eq!(lists(&n.server), before, "no relist across the rotations");
    assert_eq!(
        csrs_by(&n.server, "system:bootstrap:rotat1"),
        1,
        "renewed as the node, not bootstrapped again"
    );
    assert_eq!(status(&n)["outbox"]["parked"], serde_json::json!([]));
    n.clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offline_past_expiry_the_pods_and_upgrades_carry_on_and_every_report_arrives() {
    let token = BootstrapToken::new("offln1", "0123456789abcdef");
    let mut n = identity_node("idoff", &token, Some(8)).await;
    n.start();
    pod_runs(&n).await;
    node_certificate(&n).await;
    n.roll();
    n.wait_for(30, "PodNeedUpgrade True", |n| async move {
        n.need().is_some_and(|c| c["status"] == "True")
    })
    .await;
    n.server.set_offline(true).await.unwrap();
    n.wait_for(20, "the node certificate expired", |n| async move {
        identity(n)["lapsed"][0]["reason"] == "expired"
    })
    .await;
    // The cloud's next certificates are long ones (the re-bootstrapped node keeps its own).
    n.server.set_test_only_certificate_window(None);

    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let done = n.wait_state(90, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(done["state"], "Done", "{done}");
    assert_eq!(n.running("app").await.len(), 1);
    assert!(
        status(&n)["outbox"]["queued"].as_u64().unwrap_or(0) > 0,
        "the upgrade's reports wait"
    );

    n.server.set_offline(false).await.unwrap();
    n.wait_for(60, "a second bootstrap", |n| async move {
        csrs_by(&n.server, "system:bootstrap:offln1") == 2
    })
    .await;
    n.wait_for(60, "every queued report delivered", |n| async move {
        let s = status(n);
        s["outbox"]["queued"] == 0
            // The upgrade's last report: the pod object deleted, for the DaemonSet
            // controller to make its replacement at the new revision.
            && n.server.get("pods", "vehicle", "telemetry-sv74m").is_none()
    })
    .await;
    let s = status(&n);
    assert_eq!(s["outbox"]["parked"], serde_json::json!([]), "{s}");
    assert_eq!(s["identity"]["lapsed"], serde_json::json!([]), "{s}");
    assert!(n.queued_event_reasons().is_empty());
    n.clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_credentials_lapsed_are_shown_and_a_handed_over_token_brings_the_node_back() {
    let first = BootstrapToken::new("lapse1", "0123456789abcdef");
    let mut n = identity_node("idlapse", &first, Some(6)).await;
    // The handed-over token is sealed at rest with the device key.
    let key = n.dir.path().join("seal.key");
    std::fs::write(&key, [7u8; 32]).unwrap();
    n.edit_config(|s| format!("{s}[seal]\nkey_file = \"{}\"\n", key.display()));
    n.start();
    pod_runs(&n).await;
    node_certificate(&n).await;

    // A valid node certificate: a token is not needed.
    let second = BootstrapToken::new("lapse2", "fedcba9876543210");
    let (code, body) = http_body(&n, "PUT", "/v1/bootstrap-token", &second.bearer());
    assert_eq!(code, 409, "{body}");

    // The car park: offline past the certificate's end, and the bootstrap token expires.
    lapse(&n, "lapse1").await;
    let id = identity(&n);
    let lapsed = id["lapsed"].as_array().unwrap();
    assert_eq!(lapsed.len(), 2, "{id}");
    assert_eq!(lapsed[0]["credential"], "nodeCertificate");
    assert_eq!(lapsed[0]["reason"], "expired");
    assert_eq!(lapsed[0]["since"], id["nodeCertificate"]["notAfter"]);
    assert_eq!(lapsed[1]["credential"], "bootstrap");
    assert!(
        lapsed[1]["reason"].as_str().unwrap().contains("401"),
        "{id}"
    );
    assert!(lapsed[1]["since"].as_str().unwrap() >= lapsed[0]["since"].as_str().unwrap());

    let (ok, out) = cli(&n, &["status"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("lapsed: node certificate expired since "),
        "{out}"
    );
    assert!(
        out.contains("lapsed: bootstrap credential bootstrap token refused"),
        "{out}"
    );
    assert!(out.contains("edgehub bootstrap --token-file"), "{out}");

    let (code, body) = n.http("GET", "/v1/node");
    assert_eq!(code, 200, "{body}");
    let node: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(node["metadata"]["name"], n.name.as_str());
    let cond = node["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "CredentialsLapsed")
        .cloned()
        .unwrap();
    assert_eq!(cond["status"], "True");
    assert_eq!(cond["reason"], "BothCredentialsLapsed");
    assert!(cond["message"]
        .as_str()
        .unwrap()
        .contains("node certificate expired since"));
    // Local only: the apiserver's Node never gets it.
    let cloud = n.server.get("nodes", "", &n.name).unwrap();
    assert!(!cloud.to_string().contains("CredentialsLapsed"));
    // Offline or not, the pods ran on.
    assert_eq!(n.running("app").await.len(), 1);

    // The handover: bad input first, then the token.
    let (code, _) = http_body(&n, "PUT", "/v1/bootstrap-token", "not-a-token");
    assert_eq!(code, 400);
    let (code, _) = n.http("GET", "/v1/bootstrap-token");
    assert_eq!(code, 405);
    n.server.add_bootstrap_token(second.clone());
    let (code, body) = http_body(&n, "PUT", "/v1/bootstrap-token", &second.bearer());
    assert_eq!(code, 202, "{body}");
    n.wait_for(
        20,
        "back with a certificate from the handed-over token",
        |n| async move {
            csrs_by(&n.server, "system:bootstrap:lapse2") == 1
                && identity(n)["lapsed"] == serde_json::json!([])
        },
    )
    .await;
    let file = edgehub::identity::handover::token_path(&n.dir.path().join("data"));
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let raw = std::fs::read(&file).unwrap();
    assert!(
        !String::from_utf8_lossy(&raw).contains(&second.secret),
        "the token is sealed at rest"
    );
    assert_eq!(identity(&n)["bootstrap"]["source"], "handedOver");

    // Again, and this time through `edgehub bootstrap --token-file`.
    lapse(&n, "lapse2").await;
    let third = BootstrapToken::new("lapse3", "00112233445566aa");
    n.server.add_bootstrap_token(third.clone());
    let tf = n.dir.path().join("token");
    std::fs::write(&tf, format!("{}\n", third.bearer())).unwrap();
    let (ok, out) = cli(&n, &["bootstrap", "--token-file", tf.to_str().unwrap()]);
    assert!(ok, "{out}");
    n.wait_for(
        20,
        "back with a certificate from the CLI's token",
        |n| async move {
            csrs_by(&n.server, "system:bootstrap:lapse3") == 1
                && identity(n)["lapsed"] == serde_json::json!([])
        },
    )
    .await;
    let (code, body) = n.http("GET", "/v1/node");
    assert_eq!(code, 200);
    assert!(body.contains(r#""reason":"CredentialsValid""#), "{body}");
    n.clean().await;
}

/// Offline past the node certificate's end while the bootstrap token `id` is withdrawn; then
/// online, until the status shows both lapsed.
async fn lapse(n: &Node, id: &str) {
    n.server.set_offline(true).await.unwrap();
    n.server.remove_bootstrap_token(id);
    n.wait_for(20, "the node certificate expired", |n| async move {
        identity(n)["lapsed"][0]["reason"] == "expired"
    })
    .await;
    n.server.set_offline(false).await.unwrap();
    n.wait_for(60, "both credentials lapsed", |n| async move {
        identity(n)["lapsed"]
            .as_array()
            .is_some_and(|l| l.len() == 2)
    })
    .await;
}

/// A TCP relay whose target the test switches: the apiserver's address stays, what answers
/// behind it changes.
struct Relay {
    addr: SocketAddr,
    target: Arc<Mutex<SocketAddr>>,
}

async fn relay(target: SocketAddr) -> Relay {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let target = Arc::new(Mutex::new(target));
    let t = target.clone();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            let to = *t.lock().unwrap();
            tokio::spawn(async move {
                if let Ok(mut s) = tokio::net::TcpStream::connect(to).await {
                    let _ = tokio::io::copy_bidirectional(&mut c, &mut s).await;
                }
            });
        }
    });
    Relay { addr, target }
}

/// A server that answers plain HTTP: not TLS.
async fn plain_http() -> SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = c.read(&mut buf).await;
                let _ = c
                    .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                    .await;
                let _ = c.shutdown().await;
            });
        }
    });
    addr
}

fn link(n: &Node) -> Value {
    status(n)["link"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_failure_shows_in_the_status_changes_with_the_error_and_clears() {
    let mut n = edge::node("idtls").await;
    let plain = plain_http().await;
    let r = relay(plain).await;
    // The kubeconfig names the relay.
    let kc = n.dir.path().join("kube/kubeconfig");
    let text = std::fs::read_to_string(&kc).unwrap();
    std::fs::write(
        &kc,
        text.replace(&n.server.url(), &format!("https://{}", r.addr)),
    )
    .unwrap();
    n.start();
    n.wait_for(30, "a TLS failure: not TLS", |n| async move {
        let l = link(n);
        l["state"] == "TlsFailed"
            && l["reason"]
                .as_str()
                .is_some_and(|r| r.contains("does not speak TLS"))
    })
    .await;
    let (ok, out) = cli(&n, &["status"]);
    assert!(ok, "{out}");
    assert!(out.contains("link:   TlsFailed ("), "{out}");

    // Another apiserver, with a CA this kubeconfig does not trust: the reason follows.
    let other = FakeApiServer::start().await.unwrap();
    *r.target.lock().unwrap() = other.addr;
    n.wait_for(30, "a TLS failure: unknown CA", |n| async move {
        let l = link(n);
        l["state"] == "TlsFailed"
            && l["reason"]
                .as_str()
                .is_some_and(|r| r.contains("unknown CA"))
    })
    .await;

    // The right one: cleared by the first request that works.
    *r.target.lock().unwrap() = n.server.addr;
    n.wait_for(30, "the link up", |n| async move {
        link(n)["state"] == "Online"
    })
    .await;
    assert!(link(&n).get("reason").is_none());
    pod_runs(&n).await;
    n.clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_behind_not_before_keeps_the_certificate_and_waits_for_time() {
    let token = BootstrapToken::new("clock1", "0123456789abcdef");
    let mut n = identity_node("idclock", &token, None).await;
    // The device's clock is an hour behind the apiserver's: its certificate starts in its
    // future.
    n.server
        .set_test_only_not_before_ahead(Some(Duration::from_secs(3600)));
    n.start();
    n.wait_for(
        30,
        "a certificate not valid yet by the device clock",
        |n| async move {
            let id = identity(n);
            id["inUse"] == "nodeCertificate" && id["waitingForClock"] == true
        },
    )
    .await;
    pod_runs(&n).await;
    n.wait_for(30, "the Node registered with it", |n| async move {
        n.server.get("nodes", "", &n.name).is_some()
    })
    .await;
    let me = format!("system:node:{}", n.name);
    let path = edgehub::identity::files::credential_path(&n.dir.path().join("data"));
    let kept = std::fs::read_to_string(&path).unwrap();
    // It is kept and used: no second CSR, no lapse, the file unchanged, the link up.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(csrs_by(&n.server, "system:bootstrap:clock1"), 1);
    assert_eq!(csrs_by(&n.server, &me), 0);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), kept);
    let s = status(&n);
    assert_eq!(s["identity"]["lapsed"], serde_json::json!([]), "{s}");
    assert_eq!(s["link"]["state"], "Online", "{s}");
    let (ok, out) = cli(&n, &["status"]);
    assert!(ok, "{out}");
    assert!(out.contains("waiting for time"), "{out}");
    let (_, body) = n.http("GET", "/v1/node");
    assert!(body.contains(r#""reason":"CredentialsValid""#), "{body}");
    n.clean().await;
}

/// An image whose bootstrap kubeconfig names the handover file as its tokenFile, and a device
/// that has not been handed a token yet: the status says the bootstrap credential is missing,
/// the sealed file is never sent as a token, and the handover brings the node up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_file_that_is_the_handover_file_waits_for_the_handover() {
    let token = BootstrapToken::new("field1", "0123456789abcdef");
    let mut n = identity_node("idfield", &token, None).await;
    let file = edgehub::identity::handover::token_path(&n.dir.path().join("data"));
    let boot = n.dir.path().join("boot/kubeconfig");
    let text = std::fs::read_to_string(&boot).unwrap();
    std::fs::write(
        &boot,
        text.replace(
            &format!("token: {}", token.bearer()),
            &format!("tokenFile: {}", file.display()),
        ),
    )
    .unwrap();
    let key = n.dir.path().join("seal.key");
    std::fs::write(&key, [9u8; 32]).unwrap();
    n.edit_config(|s| format!("{s}[seal]\nkey_file = \"{}\"\n", key.display()));
    n.start();
    n.wait_for(30, "the bootstrap credential missing", |n| async move {
        let id = identity(n);
        id["inUse"] == "none"
            && id["bootstrap"]["state"] == "missing"
            && id["lapsed"][0]["reason"]
                .as_str()
                .is_some_and(|r| r.contains("no bootstrap token was handed over"))
    })
    .await;
    let (code, body) = n.http("GET", "/v1/node");
    assert_eq!(code, 200, "{body}");
    let node: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(node["metadata"]["name"], n.name.as_str());
    assert_eq!(
        node["status"]["conditions"][0]["reason"],
        "CredentialLapsed"
    );
    assert!(n.server.csrs().is_empty());

    let (code, body) = http_body(&n, "PUT", "/v1/bootstrap-token", &token.bearer());
    assert_eq!(code, 202, "{body}");
    node_certificate(&n).await;
    pod_runs(&n).await;
    assert_eq!(csrs_by(&n.server, "system:bootstrap:field1"), 1);
    assert_eq!(identity(&n)["bootstrap"]["source"], "handedOver");
    // The sealed bytes never went out as a bearer token.
    let refused: Vec<_> = n
        .server
        .requests()
        .into_iter()
        .filter(|r| r.status == 401)
        .collect();
    assert!(refused.is_empty(), "{refused:?}");
    assert!(!String::from_utf8_lossy(&std::fs::read(&file).unwrap()).contains(&token.secret));
    n.clean().await;
}
