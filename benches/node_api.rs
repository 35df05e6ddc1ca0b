//! What the node's API on port 10250 costs an idle device: VmRSS of `edgehub run` with the
//! API off and on, side by side, 0 pods cached, the runtime absent. "On" is measured once its
//! serving certificate was issued (a kubelet-serving CSR approved by the fake apiserver's
//! approver), one authorized request answered (a TokenReview and a SubjectAccessReview made
//! and cached), and 12 s of quiet after. Budget: +1 MiB.
//!
//! Prints numbers and `METRIC` lines; asserts nothing. Run: `bash cross/build.sh && cargo
//! bench --bench node_api` (or set EDGEHUB_BENCH_BIN).

mod support;

use edgehub_testsupport::{FakeApiServer, ADMIN_TOKEN};
use std::path::Path;
use std::time::Duration;
use support::{metric, Edge};

struct Rss {
    rss: u64,
    anon: u64,
    hwm: u64,
    threads: u64,
}

fn sample(e: &Edge) -> Option<Rss> {
    let pid = e.pid();
    Some(Rss {
        rss: support::proc_status_kib(pid, "VmRSS")?,
        anon: support::proc_status_kib(pid, "RssAnon")?,
        hwm: support::proc_status_kib(pid, "VmHWM")?,
        threads: support::threads(pid)?,
    })
}

/// One request to the node API over TLS (the server's certificate not checked here: the
/// tests check it), with the admin token: its status.
async fn healthz(addr: &str) -> Option<u16> {
    let cfg = support::any_server_cert();
    let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
    let tls = tokio_rustls::TlsConnector::from(cfg)
        .connect(
            rustls::pki_types::ServerName::try_from("127.0.0.1")
                .ok()?
                .to_owned(),
            tcp,
        )
        .await
        .ok()?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
        .await
        .ok()?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .uri("/healthz")
        .header("host", "127.0.0.1")
        .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .ok()?;
    Some(send.send_request(req).await.ok()?.status().as_u16())
}

async fn idle(bin: &Path, on: bool) -> Option<Rss> {
    let server = FakeApiServer::start().await.ok()?;
    support::approve_serving_csrs(&server);
    let dir = tempfile::tempdir().ok()?;
    let name = format!("nodeapi-{}", if on { "on" } else { "off" });
    let addr = format!("127.0.0.1:{}", support::free_port());
    let extra = if on {
        format!("[node]\nnode_api_addr = \"{addr}\"\n")
    } else {
        String::new()
    };
    let mut e = Edge::prepare(
        &server,
        bin,
        dir.path(),
        &name,
        &dir.path().join("no-runtime.sock"),
        &extra,
    );
    e.start(&[]);
    if on {
        let mut served = false;
        for _ in 0..600 {
            if healthz(&addr).await == Some(200) {
                served = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !served {
            println!("  node API on: never served /healthz in 60 s");
            return None;
        }
    } else {
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    tokio::time::sleep(Duration::from_secs(12)).await;
    let r = sample(&e);
    e.stop();
    r
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("node_api benchmark: run with `cargo bench --bench node_api`");
        return;
    }
    let Some(bin) = support::edgehub_bin() else {
        return;
    };
    println!("binary: {}", bin.display());
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (off, on) = tokio::join!(idle(&bin, false), idle(&bin, true));
        for (label, r) in [("off", &off), ("on", &on)] {
            if let Some(r) = r {
                println!(
                    "edgehub run idle, node API {label}: VmRSS {} KiB ({} anonymous), peak {} KiB, {} threads",
                    r.rss, r.anon, r.hwm, r.threads
                );
                metric(&format!("rss_idle_kib_node_api_{label}"), r.rss as f64, "KiB");
            }
        }
        if let (Some(off), Some(on)) = (off, on) {
            let d = on.rss as i64 - off.rss as i64;
            println!("node API on costs {d} KiB of idle RSS (budget 1024 KiB)");
            metric("rss_node_api_delta_kib", d as f64, "KiB");
        }
    });
}
