//! Local API benchmark: `GET /pods` latency (p50/p99) with 100 and 1000 cached pods, from one
//! client and from 16 concurrent ones, and throughput with 4 keep-alive connections. The
//! server runs on a runtime of its own with two workers, as in `edgehub run`; the clients on
//! another. Prints numbers and `METRIC` lines for `benches/run.sh`; asserts nothing about
//! time.
//!
//! Run: `cargo bench --bench api`.

mod support;

use bytes::Bytes;
use edgehub::api::{self, ApiState, Listener};
use edgehub::link::LinkState;
use edgehub::object::Kind;
use edgehub::store::{OpenMode, Store, StoredObject};
use edgehub_testsupport::fixture_body;
use http_body_util::{BodyExt, Empty};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn items(list: &str) -> Vec<Value> {
    fixture_body(list)["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// A store with `n` pods of the telemetry DaemonSet (3 containers each), the DaemonSets and
/// both telemetry revisions, so every pod needs an upgrade.
fn seeded_store(dir: &std::path::Path, n: usize) -> Arc<Store> {
    let store = Store::open(&dir.join("edgehub.db"), OpenMode::Normal).expect("store");
    let tmpl = items("pods_list_node")
        .into_iter()
        .find(|p| p["metadata"]["name"] == "telemetry-sv74m")
        .expect("pod");
    let c = tmpl["spec"]["containers"][0].clone();
    let pods: Vec<StoredObject> = (0..n)
        .map(|i| {
            let mut p = tmpl.clone();
            p["metadata"]["name"] = json!(format!("telemetry-{i:05}"));
            p["metadata"]["uid"] = json!(format!("00000000-0000-4000-8000-{i:012}"));
            p["spec"]["containers"] =
                json!([c.clone(), {"name": "b", "image": "x"}, {"name": "c", "image": "y"}]);
            StoredObject::from_raw(Kind::Pod, p.to_string()).expect("pod")
        })
        .collect();
    let objs = |kind, list: &str| -> Vec<StoredObject> {
        items(list)
            .into_iter()
            .map(|o| StoredObject::from_raw(kind, o.to_string()).expect("object"))
            .collect()
    };
    store
        .replace_all(Kind::Pod, None, &pods, ("pods", "1"))
        .expect("pods");
    store
        .replace_all(
            Kind::DaemonSet,
            None,
            &objs(Kind::DaemonSet, "daemonsets_list_as_node"),
            ("ds", "1"),
        )
        .expect("ds");
    store
        .replace_all(
            Kind::ControllerRevision,
            None,
            &objs(Kind::ControllerRevision, "controllerrevisions_list_rev2"),
            ("cr", "1"),
        )
        .expect("cr");
    Arc::new(store)
}

async fn get_pods(send: &mut hyper::client::conn::http1::SendRequest<Empty<Bytes>>) -> usize {
    send.ready().await.expect("connection ready");
    let req = hyper::Request::get("/pods")
        .header("host", "127.0.0.1")
        .body(Empty::new())
        .expect("request");
    let resp = send.send_request(req).await.expect("response");
    assert_eq!(resp.status(), 200);
    resp.into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes()
        .len()
}

async fn connect(addr: SocketAddr) -> hyper::client::conn::http1::SendRequest<Empty<Bytes>> {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tcp.set_nodelay(true).expect("nodelay");
    let (send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    send
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

async fn bench(server: &tokio::runtime::Handle, n: usize, samples: usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = seeded_store(dir.path(), n);
    let (_tx, link) = tokio::sync::watch::channel(LinkState::Online);
    let state = Arc::new(ApiState {
        store,
        link,
        sync_stats: vec![],
        metrics: Default::default(),
        token: None,
        socket: Default::default(),
        node_name: "edge-1".into(),
        cri: ready_runtime(),
        runtime: None,
        streams: Default::default(),
        images: None,
        image_gc: None,
        identity: None,
        commit_deadline: std::time::Duration::from_secs(1800),
    });
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    tcp.set_nonblocking(true).expect("nonblocking");
    let tcp = {
        let _in_server = server.enter();
        tokio::net::TcpListener::from_std(tcp).expect("listener")
    };
    let addr = tcp.local_addr().expect("addr");
    let (_stop, rx) = tokio::sync::watch::channel(false);
    server.spawn(api::serve(Listener::Tcp(tcp), state, rx));

    let mut send = connect(addr).await;
    let bytes = get_pods(&mut send).await; // warm up
    let mut lat = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        get_pods(&mut send).await;
        lat.push(t.elapsed());
    }
    lat.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "GET /pods, {n} pods ({} KiB): p50 {:.2} ms, p99 {:.2} ms over {samples} sequential requests",
        bytes / 1024,
        ms(percentile(&lat, 0.50)),
        ms(percentile(&lat, 0.99))
    );
    support::metric(
        &format!("get_pods_p50_ms_{n}_pods"),
        ms(percentile(&lat, 0.50)),
        "ms",
    );
    support::metric(
        &format!("get_pods_p99_ms_{n}_pods"),
        ms(percentile(&lat, 0.99)),
        "ms",
    );

    // 16 clients at once, each on its own keep-alive connection, each request timed.
    let clients = 16;
    let per_client = (samples / clients).max(10);
    let mut tasks = Vec::new();
    for _ in 0..clients {
        tasks.push(tokio::spawn(async move {
            let mut send = connect(addr).await;
            let mut lat = Vec::with_capacity(per_client);
            for _ in 0..per_client {
                let t = Instant::now();
                get_pods(&mut send).await;
                lat.push(t.elapsed());
            }
            lat
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.expect("task"));
    }
    lat.sort();
    println!(
        "GET /pods, {n} pods, {clients} concurrent clients: p50 {:.2} ms, p99 {:.2} ms over {} requests",
        ms(percentile(&lat, 0.50)),
        ms(percentile(&lat, 0.99)),
        lat.len()
    );
    support::metric(
        &format!("get_pods_p99_ms_{n}_pods_{clients}_clients"),
        ms(percentile(&lat, 0.99)),
        "ms",
    );

    let window = Duration::from_secs(3);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..4 {
        tasks.push(tokio::spawn(async move {
            let mut send = connect(addr).await;
            let mut done = 0u64;
            while start.elapsed() < window {
                get_pods(&mut send).await;
                done += 1;
            }
            done
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("task");
    }
    let rate = total as f64 / start.elapsed().as_secs_f64();
    println!("GET /pods, {n} pods: {rate:.0} requests/s with 4 keep-alive connections");
    support::metric(
        &format!("get_pods_per_s_{n}_pods_4_connections"),
        rate,
        "/s",
    );
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("api benchmark: run with `cargo bench --bench api`");
        return;
    }
    // The server's runtime: two workers, as `edgehub run` builds it.
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("server runtime");
    let clients = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("client runtime");
    clients.block_on(async {
        bench(server.handle(), 100, 500).await;
        bench(server.handle(), 1000, 100).await;
    });
}

/// A runtime health that says ready (these tests exercise the API, not the runtime).
fn ready_runtime() -> tokio::sync::watch::Receiver<edgehub::cri::CriHealth> {
    // A receiver keeps the last value after its sender is gone.
    tokio::sync::watch::channel(edgehub::cri::CriHealth::Ready {
        version: "containerd://1.6.20".into(),
    })
    .1
}
