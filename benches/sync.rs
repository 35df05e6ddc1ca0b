//! Sync benchmark: prints numbers, asserts nothing about time.
//!
//! - watch events applied per second into SQLite (store only, and end to end through the
//!   fake apiserver over TLS), with pods of 3 containers like fixtures/pods_list_node.json;
//! - initial sync time of 100 and 1000 pods, end to end;
//! - bytes written to the database per 1000 unchanged events and per 1000 bookmarks.
//!
//! Prints `METRIC` lines for `benches/run.sh` too.
//!
//! Run: `cargo bench --bench sync` (release build).

mod support;

use edgehub::config::{Config, Overrides};
use edgehub::kube::ApiClient;
use edgehub::object::Kind;
use edgehub::store::{Change, OpenMode, Store, StoredObject};
use edgehub::sync::Sync;
use edgehub_testsupport::{fixture_body, FakeApiServer, NODE_TOKEN};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A pod like the recorded telemetry pod, with three containers.
fn template_pod() -> Value {
    let mut pod = fixture_body("pods_list_node")["items"][1].clone();
    let c = pod["spec"]["containers"][0].clone();
    let mut cs = vec![];
    for i in 0..3 {
        let mut c = c.clone();
        c["name"] = json!(format!("c{i}"));
        cs.push(c);
    }
    pod["spec"]["containers"] = Value::Array(cs);
    pod
}

fn pod_named(t: &Value, i: usize) -> Value {
    let mut p = t.clone();
    p["metadata"]["name"] = json!(format!("bench-{i:05}"));
    p["metadata"]["uid"] = json!(format!("00000000-0000-4000-8000-{i:012}"));
    p
}

fn config(dir: &Path, kc: &Path) -> Config {
    let flags = Overrides {
        node_name: Some("edge-1".into()),
        data_dir: Some(dir.to_path_buf()),
        kubeconfig: Some(kc.to_path_buf()),
        ..Default::default()
    };
    let mut c = Config::resolve(None, Path::new("bench.toml"), &[], &flags, None).expect("config");
    c.sync.cursor_checkpoint = Duration::from_secs(3600);
    c.sync.max_event_bytes = 64 << 20;
    c
}

fn client(c: &Config) -> ApiClient {
    c.api_client().expect("client")
}

fn disk_bytes(db: &Path) -> u64 {
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    size(db) + size(&db.with_extension("db-wal"))
}

/// Bytes this process has caused to be written to storage (Linux), if readable.
fn io_write_bytes() -> Option<u64> {
    std::fs::read_to_string("/proc/self/io")
        .ok()?
        .lines()
        .find_map(|l| {
            l.strip_prefix("write_bytes: ")
                .and_then(|v| v.trim().parse().ok())
        })
}

async fn wait_for(mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(300);
    while !f() {
        assert!(
            Instant::now() < deadline,
            "benchmark step did not finish in 300 s"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn store_only(t: &Value) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("edgehub.db"), OpenMode::Normal).expect("store");
    let n = 2000;
    let pods: Vec<String> = (0..n)
        .map(|i| {
            let mut p = pod_named(t, i % 100);
            p["metadata"]["resourceVersion"] = json!((1000 + i).to_string());
            p.to_string()
        })
        .collect();
    let bytes = pods.iter().map(String::len).sum::<usize>() / n;
    let start = Instant::now();
    for (i, raw) in pods.into_iter().enumerate() {
        let obj = StoredObject::from_raw(Kind::Pod, raw).expect("pod");
        store
            .apply(
                Kind::Pod,
                &[Change::Upsert(obj)],
                Some(("pods", &(1000 + i).to_string())),
            )
            .expect("apply");
    }
    let secs = start.elapsed().as_secs_f64();
    println!("store: {n} MODIFIED events ({bytes} B pods, 3 containers), one fsync'd transaction each: {:.0} events/s", n as f64 / secs);
    support::metric("store_events_per_s", n as f64 / secs, "/s");

    // No-op events: the same object again, 1000 times.
    let same = StoredObject::from_raw(Kind::Pod, {
        let mut p = pod_named(t, 0);
        p["metadata"]["resourceVersion"] = json!("5000");
        p.to_string()
    })
    .expect("pod");
    store
        .apply(Kind::Pod, &[Change::Upsert(same.clone())], None)
        .expect("apply");
    let db = dir.path().join("edgehub.db");
    let (before, io_before) = (disk_bytes(&db), io_write_bytes());
    for _ in 0..1000 {
        store
            .apply(
                Kind::Pod,
                &[Change::Upsert(same.clone())],
                Some(("pods", "5000")),
            )
            .expect("apply");
    }
    let io = io_write_bytes().zip(io_before).map(|(a, b)| a - b);
    println!(
        "store: 1000 unchanged events: {} bytes of database growth, {} bytes written by the process",
        disk_bytes(&db) - before,
        io.map_or("n/a".into(), |b| b.to_string())
    );
    if let Some(b) = io {
        support::metric("bytes_written_per_1000_unchanged_events", b as f64, "B");
    }
}

async fn end_to_end(t: &Value, pods: usize) {
    let server = FakeApiServer::start().await.expect("server");
    server.seed_list(
        "pods",
        &json!({"metadata": {"resourceVersion": "1"}, "items": (0..pods).map(|i| pod_named(t, i)).collect::<Vec<_>>()}),
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let kc = server
        .write_kubeconfig(&dir.path().join("kube"), NODE_TOKEN)
        .expect("kubeconfig");
    let cfg = config(&dir.path().join("data"), &kc);
    let store = Arc::new(Store::open(&cfg.db_path(), OpenMode::Normal).expect("store"));
    let (tx, rx) = tokio::sync::watch::channel(false);
    let start = Instant::now();
    let sync = Sync::spawn(&cfg.node_name, &cfg.sync, client(&cfg), store.clone(), rx);
    wait_for(|| store.count(Kind::Pod).unwrap_or(0) == pods as u64).await;
    let ms = start.elapsed().as_secs_f64() * 1000.0;
    println!("initial sync of {pods} pods over TLS into SQLite: {ms:.0} ms");
    support::metric(&format!("initial_sync_ms_{pods}_pods"), ms, "ms");

    if pods == 100 {
        // Watch throughput: 1000 modifications streamed through the reflector.
        let n = 1000;
        let stats = sync.stats_for("pods").expect("pods reflector").clone();
        wait_for(|| stats.watches.load(Ordering::Relaxed) > 0).await;
        let start = Instant::now();
        let mut last = String::new();
        for i in 0..n {
            let p = server.modify("pods", "vehicle", &format!("bench-{:05}", i % pods), |p| {
                p["metadata"]["annotations"]["bench/seq"] = json!(i.to_string());
            });
            last = p["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or("")
                .to_string();
        }
        let name = format!("bench-{:05}", (n - 1) % pods);
        wait_for(|| {
            store
                .get(Kind::Pod, "vehicle", &name)
                .ok()
                .flatten()
                .map(|o| o.index.resource_version)
                == Some(last.clone())
        })
        .await;
        let secs = start.elapsed().as_secs_f64();
        println!(
            "end to end: {n} watch events applied in {:.0} ms: {:.0} events/s",
            secs * 1000.0,
            n as f64 / secs
        );
        support::metric("watch_events_per_s_end_to_end", n as f64 / secs, "/s");

        // Bookmarks: 1000 of them, nothing to write.
        server.set_bookmark_interval(Duration::from_millis(1));
        server.drop_connections(); // re-watch so the new interval applies
        tokio::time::sleep(Duration::from_millis(300)).await;
        let events = stats.events.load(Ordering::Relaxed);
        let (before, io_before) = (disk_bytes(&cfg.db_path()), io_write_bytes());
        wait_for(|| stats.events.load(Ordering::Relaxed) >= events + 1000).await;
        let io = io_write_bytes().zip(io_before).map(|(a, b)| a - b);
        println!(
            "end to end: 1000 bookmarks: {} bytes of database growth, {} bytes written by the process",
            disk_bytes(&cfg.db_path()) - before,
            io.map_or("n/a".into(), |b| b.to_string())
        );
        if let Some(b) = io {
            support::metric("bytes_written_per_1000_bookmarks", b as f64, "B");
        }
    }
    let _ = tx.send(true);
    sync.join().await;
}

fn main() {
    // `cargo test --benches` runs bench targets with --bench absent; only run when benchmarking.
    if !std::env::args().any(|a| a == "--bench") {
        println!("sync benchmark: run with `cargo bench --bench sync`");
        return;
    }
    let t = template_pod();
    store_only(&t);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        end_to_end(&t, 100).await;
        end_to_end(&t, 1000).await;
    });
}
