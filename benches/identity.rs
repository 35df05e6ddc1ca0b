//! What a certificate rotation costs (identity): the bytes written to flash per rotation
//! (`write_bytes` of /proc/self/io around the rounds, as benches/seal.rs counts them: the
//! credential file, its fsyncs and the directory's; the fake apiserver runs in the same
//! process but writes nothing), and the apiserver requests a rotation makes (budget: the CSR
//! create and one watch, no relist, no get). Rotations are made short with the fake's
//! test-only certificate window (8 s), so five of them take about half a minute.
//! Prints numbers and `METRIC` lines; asserts the request budget. Run:
//! `cargo bench --bench identity`.

mod support;

use edgehub::identity::{Identity, IdentityConfig};
use edgehub::kube::resource::NODES;
use edgehub::kube::ClientOptions;
use edgehub_testsupport::{BootstrapToken, FakeApiServer, TestOnlyCertWindow};
use std::sync::atomic::Ordering;
use std::time::Duration;
use support::metric;

const ROTATIONS: u64 = 5;

fn io_write_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("write_bytes: ")
                    .and_then(|v| v.trim().parse().ok())
            })
        })
        .expect("/proc/self/io has write_bytes (Linux, with task I/O accounting)")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    {
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::util::SubscriberInitExt;
        let filter = edgehub::config::log_filter(
            &std::env::var("EDGEHUB_BENCH_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .expect("EDGEHUB_BENCH_LOG is a log filter");
        tracing_subscriber::fmt()
            // The builder's own ceiling is INFO; the filter below decides instead.
            .with_max_level(tracing_subscriber::filter::LevelFilter::TRACE)
            .with_writer(std::io::stderr)
            .finish()
            .with(filter)
            .init();
    }
    let s = FakeApiServer::start().await.unwrap();
    let token = BootstrapToken::new("edge01", "0123456789abcdef");
    s.add_bootstrap_token(token.clone());
    s.set_test_only_certificate_window(Some(TestOnlyCertWindow {
        backdate: Duration::from_secs(1),
        valid_for: Duration::from_secs(7),
    }));
    let dir = tempfile::tempdir_in(
        std::env::var_os("EDGEHUB_BENCH_DIR")
            .unwrap_or_else(|| std::env::temp_dir().into_os_string()),
    )
    .unwrap();
    let boot = s
        .write_kubeconfig(&dir.path().join("etc"), &token.bearer())
        .unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let opts = ClientOptions {
        timeout: Duration::from_secs(5),
        watch_idle_timeout: Duration::from_secs(30),
        max_body: 4 << 20,
        node_name: "edge-1".into(),
    };
    let cfg = IdentityConfig {
        bootstrap_kubeconfig: Some(boot.clone()),
        cert_expiration_secs: None,
        ..IdentityConfig::default()
    };
    let (client, identity) = Identity::setup(&cfg, &boot, &data, "edge-1", opts).unwrap();
    let stats = identity.stats.clone();
    let (_stop, stop) = tokio::sync::watch::channel(false);
    tokio::spawn(identity.run(stop));
    // The node's own traffic, which confirms each new credential: a GET every second.
    let pinger = {
        let client = client.clone();
        tokio::spawn(async move {
            loop {
                client.get(&NODES, None, "edge-1").await.ok();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };
    while stats.bootstraps.load(Ordering::Relaxed) == 0 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            s.requests().len() < 1000,
            "no first certificate: {:?}",
            s.requests().last()
        );
    }
    s.clear_log();
    let written_before = io_write_bytes();
    let bytes_before = stats.bytes_written.load(Ordering::Relaxed);
    let started = std::time::Instant::now();
    while stats.rotations.load(Ordering::Relaxed) < ROTATIONS {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{} rotations in 2 minutes; requests: {:?}",
            stats.rotations.load(Ordering::Relaxed),
            s.count_by_verb()
        );
    }
    let written = io_write_bytes() - written_before;
    let file_bytes = stats.bytes_written.load(Ordering::Relaxed) - bytes_before;
    pinger.abort();
    let csr_requests: Vec<_> = s
        .requests()
        .into_iter()
        .filter(|r| r.resource.starts_with("certificatesigningrequests"))
        .collect();
    let by = |verb: &str| {
        csr_requests.iter().filter(|r| r.verb == verb).count() as f64 / ROTATIONS as f64
    };
    let (create, watch, get, list) = (by("create"), by("watch"), by("get"), by("list"));
    let other_lists = s.requests().iter().filter(|r| r.verb == "list").count();
    let unauthorized = s.requests().iter().filter(|r| r.status == 401).count();
    println!("{ROTATIONS} rotations of an 8 s test-only certificate window");
    println!(
        "  flash: {:.0} bytes per rotation written by the process ({:.0} bytes of credential file)",
        written as f64 / ROTATIONS as f64,
        file_bytes as f64 / ROTATIONS as f64
    );
    println!("  apiserver requests per rotation: {create} CSR create, {watch} CSR watch, {get} CSR get, {list} CSR list; {other_lists} lists of anything, {unauthorized} answered 401");
    metric(
        "identity_flash_bytes_per_rotation",
        (written / ROTATIONS) as f64,
        "bytes",
    );
    metric(
        "identity_file_bytes_per_rotation",
        (file_bytes / ROTATIONS) as f64,
        "bytes",
    );
    metric(
        "identity_requests_per_rotation",
        create + watch + get + list,
        "requests",
    );
    assert_eq!(
        (create, watch, get, list, other_lists, unauthorized),
        (1.0, 1.0, 0.0, 0.0, 0, 0),
        "the rotation's request budget"
    );
}
