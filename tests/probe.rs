//! HTTPS probes against a real TLS server whose CA the prober does not know (the fake
//! apiserver), as the kubelet probes a pod's self-signed endpoint: no verification, but a
//! real handshake, and the probe's headers are sent.

use edgehub::pod::probes::{run, ProbeAction, ProbeSpec};
use edgehub_testsupport::{FakeApiServer, NODE_TOKEN};
use std::time::Duration;

fn https_get(port: u16, path: &str, headers: Vec<(String, String)>) -> ProbeSpec {
    ProbeSpec {
        action: ProbeAction::HttpGet {
            https: true,
            host: None,
            port,
            path: path.into(),
            headers,
        },
        initial_delay: Duration::ZERO,
        period: Duration::from_secs(1),
        timeout: Duration::from_secs(2),
        success_threshold: 1,
        failure_threshold: 1,
    }
}

#[tokio::test]
async fn https_probes_skip_verification_and_send_their_headers() {
    let server = FakeApiServer::start().await.unwrap();
    server.seed_recorded_cluster();
    let port: u16 = server.url().rsplit(':').next().unwrap().parse().unwrap();
    // No CRI is needed for httpGet; a socket path that does not exist proves it is not used.
    let cri = edgehub::cri::CriClient::new(std::path::Path::new("/nonexistent/cri.sock"));
    let auth = vec![("Authorization".to_string(), format!("Bearer {NODE_TOKEN}"))];
    let ok = run(
        &cri,
        "c",
        "127.0.0.1",
        &https_get(port, "/api/v1/nodes/edge-1", auth),
    )
    .await;
    assert_eq!(ok, Ok(()));
    // Without the header the server answers 401: a failure that says so.
    let e = run(
        &cri,
        "c",
        "127.0.0.1",
        &https_get(port, "/api/v1/nodes/edge-1", vec![]),
    )
    .await
    .unwrap_err();
    assert_eq!(e, "HTTP probe failed with statuscode: 401");
    // A plain-HTTP listener is not an HTTPS one: the handshake fails, clearly.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let plain = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        while let Ok((mut s, _)) = l.accept().await {
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .await;
        }
    });
    let e = run(&cri, "c", "127.0.0.1", &https_get(plain, "/", vec![]))
        .await
        .unwrap_err();
    assert!(
        e.starts_with(&format!("Get \"https://127.0.0.1:{plain}/\"")),
        "{e}"
    );
}
