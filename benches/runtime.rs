//! Pod runtime benchmark, with the real containerd of scripts/cri-stack.sh (needs root):
//! - time from a pod arriving in the cache to its container running, for 1 and 20 pods,
//!   beside containerd's own RunPodSandbox + CreateContainer + StartContainer measured in the
//!   same run (one task per pod, as edgehub starts them);
//! - RSS of `edgehub run` running 20 pods (the static musl build when `bash cross/build.sh`
//!   made it, else the glibc release build; see `support::edgehub_bin`). Idle RSS with pods
//!   cached is `benches/footprint.rs`.
//!
//! Prints numbers and `METRIC` lines for `benches/run.sh`; asserts nothing about time.
//!
//! Run: `bash cross/build.sh && cargo bench --bench runtime`.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;

use edgehub::cri::{api, labels, CriClient, CriRuntime};
use edgehub::object::Kind;
use edgehub::runtime::Reconciler;
use edgehub::store::{Change, OpenMode, Store, StoredObject};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const IMAGE: &str = "127.0.0.1:5000/busybox:1.0";

fn pod(i: usize, tag: &str) -> Value {
    json!({
        "metadata": {"name": format!("bench-{tag}-{i}"), "namespace": "bench", "uid": format!("bench-{tag}-{i}-{}", std::process::id()),
            "resourceVersion": "1",
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "ds", "controller": true}]},
        "spec": {"nodeName": "edge-1", "hostNetwork": true, "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "app", "image": IMAGE, "imagePullPolicy": "IfNotPresent"}]},
    })
}

async fn running_count(c: &CriClient, node: &str) -> usize {
    c.list_containers(HashMap::from([(
        labels::NODE.to_string(),
        node.to_string(),
    )]))
    .await
    .unwrap_or_default()
    .iter()
    .filter(|x| x.state == api::ContainerState::ContainerRunning as i32)
    .count()
}

/// Cache -> running through the reconciler.
async fn through_edgehub(socket: &Path, n: usize) -> Duration {
    let dir = tempfile::tempdir().expect("tempdir");
    let store =
        Arc::new(Store::open(&dir.path().join("edgehub.db"), OpenMode::Normal).expect("store"));
    // A node name of its own per call: the warm-up's containers stop asynchronously, and a
    // measured run under the same name counted them as its own (1 pod "running" in 2 ms).
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let node = format!("bench-node-{n}-{}-{call}", std::process::id());
    let c = CriClient::new(socket);
    // The first pod list is done: without it the runtime starts nothing (sources ready).
    store
        .set_cursor(&edgehub::sync::pods_cursor_key(&node), "1")
        .expect("cursor");
    let mut r = Reconciler::new(
        CriClient::new(socket),
        store.clone(),
        None,
        dir.path().to_path_buf(),
        node.clone(),
    );
    let pods: Vec<Value> = (0..n).map(|i| pod(i, &format!("e{n}"))).collect();
    let start = Instant::now();
    let changes: Vec<Change> = pods
        .iter()
        .map(|p| Change::Upsert(StoredObject::from_raw(Kind::Pod, p.to_string()).expect("pod")))
        .collect();
    store.apply(Kind::Pod, &changes, None).expect("apply");
    while running_count(&c, &node).await < n {
        r.reconcile().await.expect("reconcile");
    }
    let took = start.elapsed();
    // Clean up: no pods desired.
    let del: Vec<Change> = pods
        .iter()
        .map(|p| Change::Delete {
            namespace: "bench".into(),
            name: p["metadata"]["name"].as_str().unwrap_or("").into(),
        })
        .collect();
    store.apply(Kind::Pod, &del, None).expect("apply");
    // Stops run in the background: wait for them, so the next measurement starts clean.
    let deadline = Instant::now() + Duration::from_secs(60);
    while running_count(&c, &node).await > 0 && Instant::now() < deadline {
        r.reconcile().await.expect("cleanup");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    took
}

/// The same work straight against containerd: sandbox, create, start, each pod in a task of
/// its own, as edgehub starts pods (no pod waits on another).
async fn containerd_alone(socket: &Path, n: usize) -> Duration {
    let logs = tempfile::tempdir().expect("tempdir");
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..n {
        let c = CriClient::new(socket);
        let logs = logs.path().to_path_buf();
        tasks.push(tokio::spawn(async move {
            let uid = format!("raw-{n}-{i}-{}", std::process::id());
            let sb_cfg = common::host_network_sandbox(
                &format!("raw-{n}-{i}"),
                &uid,
                "bench",
                &logs,
                HashMap::from([("bench".to_string(), "raw".to_string())]),
            );
            let sb = c.run_pod_sandbox(sb_cfg.clone()).await.expect("sandbox");
            let cfg = api::ContainerConfig {
                metadata: Some(api::ContainerMetadata {
                    name: "app".into(),
                    attempt: 0,
                }),
                image: Some(api::ImageSpec {
                    image: IMAGE.into(),
                    ..Default::default()
                }),
                log_path: format!("app-{i}.log"),
                ..Default::default()
            };
            let id = c.create_container(&sb, cfg, sb_cfg).await.expect("create");
            c.start_container(&id).await.expect("start");
            (sb, id)
        }));
    }
    let mut made = Vec::new();
    for t in tasks {
        made.push(t.await.expect("containerd task"));
    }
    let took = start.elapsed();
    let c = CriClient::new(socket);
    for (sb, id) in made {
        let _ = c.stop_container(&id, 0).await;
        let _ = c.remove_container(&id).await;
        let _ = c.stop_pod_sandbox(&sb).await;
        let _ = c.remove_pod_sandbox(&sb).await;
    }
    took
}

/// `edgehub run` (the release binary) against `server`, with its own data dir.
fn spawn_edgehub(
    server: &edgehub_testsupport::FakeApiServer,
    dir: &Path,
    socket: &Path,
) -> Option<std::process::Child> {
    // The static musl build the devices run when built, else the glibc release build, or
    // EDGEHUB_BENCH_BIN (their allocators keep different amounts of memory).
    let bin = support::edgehub_bin()?;
    println!("RSS of {}", bin.display());
    let kc = server
        .write_kubeconfig(&dir.join("kube"), edgehub_testsupport::NODE_TOKEN)
        .ok()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    std::process::Command::new(&bin)
        .args([
            "--node-name",
            "edge-1",
            "--api-addr",
            &format!("127.0.0.1:{port}"),
        ])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--kubeconfig")
        .arg(&kc)
        .arg("--cri-socket")
        .arg(socket)
        .arg("run")
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()
}

fn vm_rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
}

fn stop(mut child: std::process::Child) {
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
}

async fn rss_of_edgehub_with_20_pods(socket: &Path) -> Option<u64> {
    let server = edgehub_testsupport::FakeApiServer::start()
        .await
        .expect("fake apiserver");
    for i in 0..20 {
        server.apply("pods", pod(i, "rss"));
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let child = spawn_edgehub(&server, dir.path(), socket)?;
    let c = CriClient::new(socket);
    let deadline = Instant::now() + Duration::from_secs(60);
    while running_count(&c, "edge-1").await < 20 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss = vm_rss_kib(child.id());
    let running = running_count(&c, "edge-1").await;
    stop(child);
    // The pods stay in containerd after edgehub exits (they are meant to): remove them.
    for sb in c
        .list_pod_sandbox(HashMap::from([(
            labels::NODE.to_string(),
            "edge-1".to_string(),
        )]))
        .await
        .unwrap_or_default()
    {
        let _ = c.stop_pod_sandbox(&sb.id).await;
        let _ = c.remove_pod_sandbox(&sb.id).await;
    }
    println!(
        "edgehub run with {running} running pods: VmRSS {} KiB",
        rss.unwrap_or(0)
    );
    rss
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("runtime benchmark: run with `cargo bench --bench runtime` (root, containerd test stack)");
        return;
    }
    let socket = common::cri_stack();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        // Warm up: the image is pulled and the sandbox image is present.
        let _ = through_edgehub(&socket, 1).await;
        for n in [1, 20] {
            let eh = through_edgehub(&socket, n).await;
            let raw = containerd_alone(&socket, n).await;
            println!(
                "{n} pod(s): cache -> running {:.0} ms through edgehub; containerd's own sandbox+create+start {:.0} ms; edgehub adds {:.0} ms ({:.1} ms per pod)",
                eh.as_secs_f64() * 1000.0,
                raw.as_secs_f64() * 1000.0,
                (eh.as_secs_f64() - raw.as_secs_f64()) * 1000.0,
                (eh.as_secs_f64() - raw.as_secs_f64()) * 1000.0 / n as f64
            );
            let suffix = if n == 1 { "_1_pod" } else { "" };
            support::metric(
                &format!("pod_start_overhead_ms_per_pod{suffix}"),
                (eh.as_secs_f64() - raw.as_secs_f64()) * 1000.0 / n as f64,
                "ms",
            );
            support::metric(
                &format!("pod_start_ms_{n}_pods"),
                eh.as_secs_f64() * 1000.0,
                "ms",
            );
            support::metric(
                &format!("containerd_start_ms_{n}_pods"),
                raw.as_secs_f64() * 1000.0,
                "ms",
            );
        }
        if let Some(kib) = rss_of_edgehub_with_20_pods(&socket).await {
            support::metric("rss_kib_20_running_pods", kib as f64, "KiB");
        }
    });
}
