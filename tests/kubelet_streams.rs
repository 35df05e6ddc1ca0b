//! `kubectl exec`, `attach` and `port-forward` as the apiserver forwards them to a node: a
//! real `edgehub run` with its node API on (TLS with a serving certificate approved through
//! the fake apiserver's CSR API), a real pod on the pod network in containerd (the stack of
//! scripts/cri-stack.sh, the `web` image: busybox httpd on 8080 and a line a second), and a
//! WebSocket client speaking `v4.channel.k8s.io` through edgehub to containerd's streaming
//! server. Needs root; without it this fails, loudly.

mod common;
#[path = "common/edge.rs"]
mod edge;
#[path = "common/node_api.rs"]
mod node_api;

use edgehub_testsupport::{Approval, ADMIN_TOKEN, KUBELET_SERVING_SIGNER};
use futures_util::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Empty};
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{self, Message};

const POD: &str = "telemetry-sv74m";
const NS: &str = "vehicle";
const JANE: &str = "jane-token";

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;

/// Opens a WebSocket on the node API at `path` with `token`, asking for `protocol`.
async fn ws(
    addr: SocketAddr,
    ca: &str,
    path: &str,
    protocol: &str,
) -> Result<Ws, tungstenite::Error> {
    let tls = node_api::connect(addr, ca)
        .await
        .expect("TLS to the node API");
    let mut req = format!("wss://127.0.0.1:{}{path}", addr.port())
        .into_client_request()
        .unwrap();
    req.headers_mut().insert(
        "authorization",
        format!("Bearer {ADMIN_TOKEN}").parse().unwrap(),
    );
    req.headers_mut()
        .insert("sec-websocket-protocol", protocol.parse().unwrap());
    let (ws, resp) = tokio_tungstenite::client_async(req, tls).await?;
    assert_eq!(
        resp.headers()
            .get("sec-websocket-protocol")
            .and_then(|v| v.to_str().ok()),
        Some(protocol)
    );
    Ok(ws)
}

/// What came back on each channel of a `v4.channel.k8s.io` session.
#[derive(Debug, Default)]
struct Channels {
    stdout: String,
    stderr: String,
    status: Option<Value>,
}

/// Reads the session until the server closes it (or `secs` pass: a panic), demultiplexing
/// the channels by their first byte.
async fn drain(ws: &mut Ws, secs: u64) -> Channels {
    let mut out = Channels::default();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let msg = tokio::time::timeout_at(deadline, ws.next())
            .await
            .unwrap_or_else(|_| panic!("the session did not end within {secs} s: {out:?}"));
        match msg {
            None | Some(Ok(Message::Close(_))) => return out,
            Some(Ok(Message::Binary(b))) if !b.is_empty() => {
                let text = String::from_utf8_lossy(&b[1..]).into_owned();
                match b[0] {
                    1 => out.stdout.push_str(&text),
                    2 => out.stderr.push_str(&text),
                    3 if !text.is_empty() => {
                        out.status = Some(serde_json::from_str(&text).expect("a JSON Status"))
                    }
                    _ => {}
                }
            }
            Some(Ok(_)) => {}
            // The server may drop the TCP connection right after its close frame.
            Some(Err(_)) => return out,
        }
    }
}

/// Sends `bytes` on channel `ch`.
async fn send(ws: &mut Ws, ch: u8, bytes: &[u8]) {
    let mut m = vec![ch];
    m.extend_from_slice(bytes);
    ws.send(Message::Binary(m.into())).await.unwrap();
}

/// One plain request to the node API (no body), with `token` and `headers`; the status, the
/// response's headers and its body (read only when it is not a 101).
async fn request(
    addr: SocketAddr,
    ca: &str,
    method: &str,
    path: &str,
    token: &str,
    headers: &[(&str, &str)],
) -> (u16, hyper::HeaderMap, String) {
    let tls = node_api::connect(addr, ca).await.unwrap();
    let (mut tx, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn.with_upgrades());
    let mut b = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "127.0.0.1")
        .header("authorization", format!("Bearer {token}"));
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = tokio::time::timeout(
        Duration::from_secs(15),
        tx.send_request(b.body(Empty::<bytes::Bytes>::new()).unwrap()),
    )
    .await
    .expect("an answer within 15 s")
    .unwrap();
    let (code, headers) = (resp.status().as_u16(), resp.headers().clone());
    if code == 101 {
        return (code, headers, String::new());
    }
    let body = tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect())
        .await
        .unwrap()
        .unwrap()
        .to_bytes();
    (code, headers, String::from_utf8_lossy(&body).into_owned())
}

const WS_UPGRADE: &[(&str, &str)] = &[
    ("connection", "Upgrade"),
    ("upgrade", "websocket"),
    ("sec-websocket-version", "13"),
    ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
    ("sec-websocket-protocol", "v4.channel.k8s.io"),
];

#[tokio::test]
async fn exec_attach_and_port_forward_through_the_node_api_of_a_running_edgehub() {
    let mut n = edge::node_shaped("streams", edge::Shape::PodNetwork).await;
    let _cleanup = common::NodeCleanup {
        node: n.name.clone(),
        socket: n.cri.socket().to_path_buf(),
    };
    n.server.add_token(JANE, "jane");
    let node_user = format!("system:node:{}", n.name);
    n.server.set_csr_approver(Some(Arc::new(
        move |req: &edgehub_testsupport::CsrRequest| {
            if req.signer_name == KUBELET_SERVING_SIGNER && req.username == node_user {
                Approval::Approve {
                    reason: "TestApproved".into(),
                    message: "the node's own serving CSR".into(),
                }
            } else {
                Approval::Pending
            }
        },
    )));
    let ca = n.dir.path().join("client-ca.crt");
    std::fs::write(&ca, &n.server.pki.ca_pem).unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{}", common::free_port())
        .parse()
        .unwrap();
    n.edit_config(|c| {
        format!(
            "{c}[node]\nnode_api_addr = \"{addr}\"\nnode_api_client_ca_file = \"{}\"\n\
             node_api_max_streams = 2\nnode_api_idle_timeout_secs = 3\n",
            ca.display()
        )
    });
    n.start();
    let ca = n.server.pki.ca_pem.clone();

    // The pod runs, and the node API serves.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let served = node_api::connect(addr, &ca).await.is_ok();
        if served && !n.running("app").await.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no node API or no pod:\n{}",
            n.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // On the pod network: port-forward has a network namespace of the pod's own to enter.
    let sandboxes = n.sandboxes().await;
    assert_eq!(sandboxes.len(), 1, "{sandboxes:?}");
    let ip = n.sandbox_ip(&sandboxes[0]).await;
    assert!(
        !ip.is_empty() && ip != "127.0.0.1",
        "the pod's address: {ip:?}"
    );
    let exec = |q: &str| format!("/exec/{NS}/{POD}/app?{q}");

    // exec of echo: its stdout, then a Success status on the error channel.
    let mut s = ws(
        addr,
        &ca,
        &exec("command=echo&command=hello&output=1&error=1"),
        "v4.channel.k8s.io",
    )
    .await
    .expect("exec upgraded");
    let got = drain(&mut s, 20).await;
    assert_eq!(got.stdout, "hello\n", "{got:?}");
    assert_eq!(got.status.as_ref().unwrap()["status"], "Success", "{got:?}");

    // A command that exits 3: the exit code in the status, as the kubelet reports it.
    let mut s = ws(
        addr,
        &ca,
        &exec("command=sh&command=-c&command=echo+oops+%3E%262%3B+exit+3&output=1&error=1"),
        "v4.channel.k8s.io",
    )
    .await
    .unwrap();
    let got = drain(&mut s, 20).await;
    assert_eq!(got.stderr, "oops\n", "{got:?}");
    let status = got.status.expect("a status");
    assert_eq!(status["status"], "Failure", "{status}");
    assert_eq!(status["reason"], "NonZeroExitCode", "{status}");
    assert_eq!(
        status["details"]["causes"][0],
        serde_json::json!({"reason": "ExitCode", "message": "3"}),
        "{status}"
    );

    // An interactive shell on stdin.
    let mut s = ws(
        addr,
        &ca,
        &exec("command=sh&input=1&output=1&error=1"),
        "v4.channel.k8s.io",
    )
    .await
    .unwrap();
    send(&mut s, 0, b"echo $((6*7))\n").await;
    send(&mut s, 0, b"exit\n").await;
    let got = drain(&mut s, 20).await;
    assert_eq!(got.stdout, "42\n", "{got:?}");
    assert_eq!(got.status.as_ref().unwrap()["status"], "Success", "{got:?}");

    // The same with a TTY (and a resize on channel 4): the terminal echoes what was typed
    // and ends lines with CRLF; no separate stderr.
    let mut s = ws(
        addr,
        &ca,
        &exec("command=sh&input=1&output=1&error=1&tty=1"),
        "v4.channel.k8s.io",
    )
    .await
    .unwrap();
    send(&mut s, 4, br#"{"Width":100,"Height":30}"#).await;
    send(&mut s, 0, b"stty size; echo $((6*7))\n").await;
    send(&mut s, 0, b"exit\n").await;
    let got = drain(&mut s, 20).await;
    assert!(got.stdout.contains("30 100\r\n"), "{got:?}");
    assert!(got.stdout.contains("42\r\n"), "{got:?}");
    assert_eq!(got.status.as_ref().unwrap()["status"], "Success", "{got:?}");

    // attach: the container's own output, live (it prints a line a second).
    let mut s = ws(
        addr,
        &ca,
        &format!("/attach/{NS}/{POD}/app?output=1&error=1"),
        "v4.channel.k8s.io",
    )
    .await
    .expect("attach upgraded");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut seen = String::new();
    while !seen.contains("hello from 1.0 (web)\n") {
        match tokio::time::timeout_at(deadline, s.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) if b.first() == Some(&1) => {
                seen.push_str(&String::from_utf8_lossy(&b[1..]))
            }
            Ok(Some(Ok(_))) => {}
            other => panic!("attach ended or timed out: {other:?}, output {seen:?}"),
        }
    }
    drop(s);

    // port-forward to httpd on 8080 in the pod's network namespace: an HTTP GET through the
    // forwarded stream. Each port has a data and an error channel, each opened by the port
    // number (two bytes, little endian).
    let mut s = ws(
        addr,
        &ca,
        &format!("/portForward/{NS}/{POD}?port=8080"),
        "v4.channel.k8s.io",
    )
    .await
    .expect("port-forward upgraded");
    send(&mut s, 0, b"GET / HTTP/1.0\r\nHost: localhost\r\n\r\n").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let mut data: Vec<u8> = Vec::new();
    let mut opened = 0;
    while !String::from_utf8_lossy(&data).contains("web 1.0\n") {
        match tokio::time::timeout_at(deadline, s.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) if b.first() == Some(&0) => {
                if opened == 0 {
                    assert_eq!(&b[1..3], &8080u16.to_le_bytes(), "the data channel's port");
                    opened = 1;
                    data.extend_from_slice(&b[3..]);
                } else {
                    data.extend_from_slice(&b[1..]);
                }
            }
            Ok(Some(Ok(Message::Binary(b)))) if b.first() == Some(&1) && b.len() > 3 => {
                panic!("port-forward error: {}", String::from_utf8_lossy(&b[3..]))
            }
            Ok(Some(Ok(_))) => {}
            other => panic!(
                "port-forward ended or timed out: {other:?}, got {:?}",
                String::from_utf8_lossy(&data)
            ),
        }
    }
    let page = String::from_utf8_lossy(&data);
    assert!(page.starts_with("HTTP/1.1 200 OK\r\n"), "{page}");
    drop(s);

    // SPDY (what kubectl speaks): proxied, the protocol the runtime chose echoed.
    let spdy = [
        ("connection", "Upgrade"),
        ("upgrade", "SPDY/3.1"),
        ("x-stream-protocol-version", "v4.channel.k8s.io"),
    ];
    let (code, headers, body) = request(
        addr,
        &ca,
        "POST",
        &exec("command=true&output=1"),
        ADMIN_TOKEN,
        &spdy,
    )
    .await;
    assert_eq!(code, 101, "{body}");
    assert_eq!(headers["x-stream-protocol-version"], "v4.channel.k8s.io");
    assert_eq!(headers["upgrade"], "SPDY/3.1");

    // Refusals, as the kubelet answers them (the body `None`: not compared). An unknown
    // container: the kubelet's GetExec finds no running container of that name and answers
    // through streaming.WriteError, 500 with its text.
    let forbidden = "Forbidden (user=jane, verb=create, resource=nodes, subresource(s)=[proxy])\n";
    let cases: [(&str, String, &str, u16, Option<&str>); 7] = [
        (
            "GET",
            format!("/exec/{NS}/nosuchpod/app?command=true&output=1"),
            ADMIN_TOKEN,
            404,
            Some("pod does not exist"),
        ),
        (
            "GET",
            format!("/exec/{NS}/{POD}/nosuch?command=true&output=1"),
            ADMIN_TOKEN,
            500,
            Some("container not found (\"nosuch\")"),
        ),
        (
            "GET",
            format!("/portForward/{NS}/{POD}/not-its-uid?port=8080"),
            ADMIN_TOKEN,
            404,
            Some("pod not found"),
        ),
        (
            "GET",
            exec("command=true"),
            ADMIN_TOKEN,
            400,
            Some("you must specify at least 1 of stdin, stdout, stderr"),
        ),
        (
            "GET",
            format!("/portForward/{NS}/{POD}"),
            ADMIN_TOKEN,
            400,
            Some("query parameter \"port\" is required"),
        ),
        ("GET", exec("command=true&output=1"), "bogus", 401, None),
        (
            "POST",
            exec("command=true&output=1"),
            JANE,
            403,
            Some(forbidden),
        ),
    ];
    for (method, path, token, want, text) in cases {
        let (code, _, body) = request(addr, &ca, method, &path, token, WS_UPGRADE).await;
        assert_eq!(code, want, "{method} {path}: {body}");
        if let Some(t) = text {
            assert_eq!(body, t, "{method} {path}");
        }
    }

    // The streams limit (2 here): two open shells hold both; a third is refused with 429.
    let mut one = ws(
        addr,
        &ca,
        &exec("command=sh&input=1&output=1"),
        "v4.channel.k8s.io",
    )
    .await
    .unwrap();
    // Its idle clock starts once edgehub has both upgrades: after this, before `ws` returns.
    let two_asked = Instant::now();
    let mut two = ws(
        addr,
        &ca,
        &exec("command=sh&input=1&output=1"),
        "v4.channel.k8s.io",
    )
    .await
    .unwrap();
    match ws(
        addr,
        &ca,
        &exec("command=true&output=1"),
        "v4.channel.k8s.io",
    )
    .await
    {
        Err(tungstenite::Error::Http(resp)) => {
            assert_eq!(resp.status().as_u16(), 429);
            let body =
                String::from_utf8_lossy(resp.body().as_deref().unwrap_or_default()).into_owned();
            assert!(body.contains("max_streams"), "{body}");
        }
        other => panic!("a third stream: {:?}", other.map(|_| "upgraded")),
    }
    // Ending one gives its place back.
    send(&mut one, 0, b"exit\n").await;
    drain(&mut one, 20).await;
    drop(one);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match ws(
            addr,
            &ca,
            &exec("command=echo&command=again&output=1"),
            "v4.channel.k8s.io",
        )
        .await
        {
            Ok(mut s) => {
                assert_eq!(drain(&mut s, 20).await.stdout, "again\n");
                break;
            }
            Err(tungstenite::Error::Http(r)) if r.status() == 429 => {
                assert!(Instant::now() < deadline, "the permit never came back")
            }
            Err(e) => panic!("{e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Idle: the second shell, silent since it was asked for, is closed by edgehub after the idle
    // timeout (3 s here), its command unfinished (no status).
    let got = drain(&mut two, 20).await;
    assert!(got.status.is_none(), "{got:?}");
    assert!(
        two_asked.elapsed() >= Duration::from_secs(3),
        "closed before it was idle: {:?}",
        two_asked.elapsed()
    );
    n.clean().await;
}
