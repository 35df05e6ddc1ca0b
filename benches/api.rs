//! Local API benchmark: `GET /pods` latency (p50/p99) with 100 and 1000 cached pods, from one
//! client and from 16 concurrent ones (each connection's first request timed apart), offline
//! (the cache unchanged) and online (a pod changed every second, so the kept list is rendered
//! again after each change), and throughput with 4 keep-alive connections. The server runs on
//! a runtime of its own with two workers, as in `edgehub run`; the clients on another. Prints
//! numbers and `METRIC` lines for `benches/run.sh`; asserts nothing about time.
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
    // Read to the end and count, as `curl -o /dev/null` would: the client runtime's one
    // thread serves all 16 clients, and joining each body into one buffer (a 549 KiB copy)
    // was a fifth of that thread's time, latency charged to the server.
    let mut body = resp.into_body();
    let mut len = 0;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("body").into_data() {
            len += data.len();
        }
    }
    len
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

/// What [`measure`] times.
struct Timings {
    /// The body's length.
    bytes: usize,
    /// One client, one keep-alive connection, each request after the first.
    one: Vec<Duration>,
    /// 16 clients at once, each on its own keep-alive connection, each request after the first.
    many: Vec<Duration>,
    /// The first request of each of those 16 connections, opened at once.
    first: Vec<Duration>,
}

/// Times `samples` sequential requests on one connection, then 16 clients at once. On each
/// connection the first request is a warm-up, timed apart: it pays for the connection's new
/// socket buffers (16 at once: 1.5-7 ms here), which later requests on it do not.
async fn measure(addr: SocketAddr, samples: usize) -> Timings {
    let mut send = connect(addr).await;
    let bytes = get_pods(&mut send).await; // warm up (and render)
    let mut one = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        get_pods(&mut send).await;
        one.push(t.elapsed());
    }
    one.sort();
    // 16 clients at once, each on its own keep-alive connection, each request timed; the
    // timed requests start together, once every connection has had its first.
    let clients = 16;
    let per_client = (samples / clients).max(10);
    let barrier = Arc::new(tokio::sync::Barrier::new(clients));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let mut send = connect(addr).await;
            get_pods(&mut send).await;
            let first = t.elapsed();
            barrier.wait().await;
            let mut lat = Vec::with_capacity(per_client);
            for _ in 0..per_client {
                let t = Instant::now();
                get_pods(&mut send).await;
                lat.push(t.elapsed());
            }
            (first, lat)
        }));
    }
    let mut many = Vec::new();
    let mut first = Vec::new();
    for t in tasks {
        let (f, lat) = t.await.expect("task");
        first.push(f);
        many.extend(lat);
    }
    many.sort();
    first.sort();
    Timings {
        bytes,
        one,
        many,
        first,
    }
}

/// `GET /pods` with `n` pods cached: offline (nothing changes the cache) and online (a watch
/// event changes a pod once a second, as the reflectors write them, so the kept list is
/// rendered again after each), through the real HTTP server.
async fn bench(server: &tokio::runtime::Handle, n: usize, samples: usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = seeded_store(dir.path(), n);
    let (_tx, link) = tokio::sync::watch::channel(LinkState::Online);
    let state = Arc::new(ApiState {
        store: store.clone(),
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
        pods: Default::default(),
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
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;

    for online in [false, true] {
        let (label, suffix) = if online {
            ("online, a pod changed every second", "_online")
        } else {
            ("offline", "")
        };
        let writer = online.then(|| {
            let store = store.clone();
            tokio::task::spawn_blocking(move || {
                let mut pod: Value =
                    serde_json::from_str(&store.list(Kind::Pod).expect("pods")[0].raw)
                        .expect("pod");
                let stop = Instant::now() + Duration::from_secs(3600);
                let mut rv = 1_000_000u64;
                while Instant::now() < stop {
                    std::thread::sleep(Duration::from_secs(1));
                    if STOP_WRITER.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    rv += 1;
                    pod["metadata"]["resourceVersion"] = json!(rv.to_string());
                    pod["metadata"]["annotations"] = json!({"bench/rv": rv.to_string()});
                    let obj = StoredObject::from_raw(Kind::Pod, pod.to_string()).expect("pod");
                    store
                        .apply(Kind::Pod, &[edgehub::store::Change::Upsert(obj)], None)
                        .expect("apply");
                }
            })
        });
        STOP_WRITER.store(false, std::sync::atomic::Ordering::Relaxed);
        let Timings {
            bytes,
            one,
            many,
            first,
        } = measure(addr, samples).await;
        println!(
            "GET /pods, {n} pods ({} KiB), {label}: one client p50 {:.2} ms, p99 {:.2} ms over {samples} requests; 16 clients at once p50 {:.2} ms, p99 {:.2} ms over {}; the first on each of 16 new connections median {:.2} ms, worst {:.2} ms",
            bytes / 1024,
            ms(percentile(&one, 0.50)),
            ms(percentile(&one, 0.99)),
            ms(percentile(&many, 0.50)),
            ms(percentile(&many, 0.99)),
            many.len(),
            ms(percentile(&first, 0.50)),
            ms(percentile(&first, 1.0)),
        );
        println!(
            "  16 clients: worst {:.2} ms, {} of {} over 5 ms",
            ms(percentile(&many, 1.0)),
            many.iter().filter(|d| d.as_secs_f64() > 0.005).count(),
            many.len()
        );
        support::metric(
            &format!("get_pods_p50_ms_{n}_pods{suffix}"),
            ms(percentile(&one, 0.50)),
            "ms",
        );
        support::metric(
            &format!("get_pods_p99_ms_{n}_pods{suffix}"),
            ms(percentile(&one, 0.99)),
            "ms",
        );
        support::metric(
            &format!("get_pods_p99_ms_{n}_pods_16_clients{suffix}"),
            ms(percentile(&many, 0.99)),
            "ms",
        );
        support::metric(
            &format!("get_pods_first_worst_ms_{n}_pods_16_new_connections{suffix}"),
            ms(percentile(&first, 1.0)),
            "ms",
        );
        if let Some(w) = writer {
            STOP_WRITER.store(true, std::sync::atomic::Ordering::Relaxed);
            let _ = w.await;
        }
    }

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

/// Ends the online runs' writer.
static STOP_WRITER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

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
        // 4000 at 100 pods (about 4 s of 16 clients): a stall of the server (a render after
        // a change, or the VM taking a core away) delays all 16 requests in flight at once,
        // 1.6 % of 992 samples, so with 1000 one stall anywhere in a 1 s window set the p99.
        bench(server.handle(), 100, 4000).await;
        bench(server.handle(), 1000, 300).await;
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
