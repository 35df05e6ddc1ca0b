//! Flash writes at steady state (needs root and the containerd test stack): `edgehub run` (the
//! binary devices run) with 5 running pods, each with a readiness and a liveness probe (exec,
//! every 5 and 10 s), a ConfigMap and a service-account token; the fake apiserver sends a
//! bookmark every 60 s as a real one does, and edgehub renews its Lease every 10 s and
//! reports Node status every 5 minutes (the shipped defaults). Once the pods are Ready and
//! settled, over a window (10 minutes, the shipped `cursor_checkpoint_secs`, so the window
//! sees one checkpoint of the watches' bookmark progress; `EDGEHUB_FLASH_WINDOW_SECS`):
//! - `write_bytes` of /proc/PID/io (what edgehub caused to be written to storage);
//! - the growth of its files: the database, its WAL and everything else in the data dir but
//!   the containers' own logs (containerd writes those);
//!
//! both extrapolated per hour. Also the apiserver requests in the window.
//!
//! Prints numbers and `METRIC` lines for `benches/run.sh`; asserts nothing about time.
//! Run: `bash cross/build.sh && cargo bench --bench flash`.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;

use edgehub::cri::{labels, CriClient, CriRuntime};
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};
use support::{metric, Edge};

const PODS: usize = 5;

/// Bytes of the files under `dir`, leaving out the containers' logs (`pods/<uid>/logs`).
fn tree_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| {
            let p = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() && p.file_name().is_some_and(|n| n == "logs") => 0,
                Ok(t) if t.is_dir() => tree_bytes(&p),
                Ok(_) => e.metadata().map(|m| m.len()).unwrap_or(0),
                Err(_) => 0,
            }
        })
        .sum()
}

fn db_bytes(data: &Path) -> u64 {
    ["edgehub.db", "edgehub.db-wal"]
        .iter()
        .map(|f| {
            std::fs::metadata(data.join(f))
                .map(|m| m.len())
                .unwrap_or(0)
        })
        .sum()
}

fn ready(server: &edgehub_testsupport::FakeApiServer, name: &str) -> bool {
    server.get("pods", "bench", name).is_some_and(|p| {
        p["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "flash benchmark: run with `cargo bench --bench flash` (root, containerd test stack)"
        );
        return;
    }
    let Some(bin) = support::edgehub_bin() else {
        return;
    };
    let window = Duration::from_secs(
        std::env::var("EDGEHUB_FLASH_WINDOW_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(600),
    );
    println!("binary: {}; window {} s", bin.display(), window.as_secs());
    let socket = common::cri_stack();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let server = support::recorded_server().await;
        let node = format!("flash-{}", std::process::id());
        for i in 0..PODS {
            let name = format!("flash-{i}");
            server.apply(
                "configmaps",
                json!({"metadata": {"name": format!("cfg-{i}"), "namespace": "bench"}, "data": {"k": "v"}}),
            );
            server.apply(
                "pods",
                json!({
                    "metadata": {"name": name, "namespace": "bench", "uid": format!("{node}-{i}"),
                        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "ds", "controller": true}]},
                    "spec": {"nodeName": node, "hostNetwork": true, "terminationGracePeriodSeconds": 0,
                        "volumes": [
                            {"name": "cfg", "configMap": {"name": format!("cfg-{i}")}},
                            {"name": "kube-api-access", "projected": {"sources": [
                                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}]}}],
                        "containers": [{"name": "app", "image": "127.0.0.1:5000/busybox:1.0",
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["sh", "-c", "touch /tmp/ready; while true; do sleep 1; done"],
                            "readinessProbe": {"exec": {"command": ["cat", "/tmp/ready"]}, "periodSeconds": 5},
                            "livenessProbe": {"exec": {"command": ["true"]}, "periodSeconds": 10}}]},
                    "status": {"phase": "Pending"},
                }),
            );
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let mut e = Edge::prepare(&server, &bin, dir.path(), &node, &socket, "");
        e.start(&[]);
        let all_ready = support::wait_for(120, || {
            (0..PODS).all(|i| ready(&server, &format!("flash-{i}")))
        })
        .await;
        if !all_ready {
            println!("pods not Ready after 120 s; see {}", dir.path().join("edgehub.log").display());
        } else {
            // Settled: the first status reports and the sources are written.
            tokio::time::sleep(Duration::from_secs(20)).await;
            let data = dir.path().join("data");
            let pid = e.pid();
            let (io0, tree0, db0) = (
                support::io_write_bytes(pid),
                tree_bytes(&data),
                db_bytes(&data),
            );
            server.clear_log();
            let t = Instant::now();
            tokio::time::sleep(window).await;
            let secs = t.elapsed().as_secs_f64();
            let (io1, tree1, db1) = (
                support::io_write_bytes(pid),
                tree_bytes(&data),
                db_bytes(&data),
            );
            let per_hour = |b: u64| b as f64 * 3600.0 / secs / 1024.0;
            let io = io1.zip(io0).map(|(a, b)| a.saturating_sub(b));
            let grown = tree1.saturating_sub(tree0);
            let db_grown = db1.saturating_sub(db0);
            let requests = server.count_by_verb();
            println!(
                "steady state, {PODS} pods with probes, over {secs:.0} s: write_bytes {} B, data dir grew {grown} B (database and WAL {db_grown} B); per hour {} KiB written, {:.1} KiB of growth (budget 100 KiB/h)",
                io.map_or("n/a".into(), |b| b.to_string()),
                io.map_or("n/a".into(), |b| format!("{:.1}", per_hour(b))),
                per_hour(grown),
            );
            println!("  apiserver requests in the window: {requests:?}");
            if let Some(b) = io {
                // The budget is what reaches the flash: the larger of the two views.
                metric("flash_write_kib_per_hour", per_hour(b.max(grown)), "KiB/h");
                metric("flash_write_bytes_window", b as f64, "B");
            }
            metric("flash_growth_kib_per_hour", per_hour(grown), "KiB/h");
            metric(
                "apiserver_requests_per_idle_minute",
                requests.values().sum::<usize>() as f64 * 60.0 / secs,
                "",
            );
        }
        e.stop();
        let cri = CriClient::new(&socket);
        for sb in cri
            .list_pod_sandbox(HashMap::from([(labels::NODE.to_string(), node.clone())]))
            .await
            .unwrap_or_default()
        {
            let _ = cri.stop_pod_sandbox(&sb.id).await;
            let _ = cri.remove_pod_sandbox(&sb.id).await;
        }
    });
}
