//! Start-up, measured on the binary devices run (`support::edgehub_bin`), with the real
//! containerd of scripts/cri-stack.sh (needs root):
//! - **offline power cycle**: `edgehub run` starts the two recorded DaemonSet pods
//!   (`telemetry` and `gateway`: two containers each, a ConfigMap, the projected token, an
//!   exec readiness probe) online; then the power goes: edgehub is SIGKILLed, every sandbox
//!   of the node stopped (its containers exit, as a reboot leaves them) and its tmpfs volumes
//!   unmounted; edgehub starts again with the apiserver unreachable. Timed from the exec to
//!   every container of both pods running again, beside containerd's own work for the same
//!   pods in the same run (a sandbox, then create and start of each container, the pods side
//!   by side, as edgehub does it): the difference is what edgehub's start adds;
//! - **pod start right after the node is Ready**: a fresh `edgehub run`, online; as soon as
//!   its Node reports Ready, the two pods are bound to it; timed until both are Ready on the
//!   apiserver, beside containerd's own work for them (their readiness probes run every 2 s:
//!   the first one after the containers start is part of both edgehub's time and a kubelet's).
//!
//! `EDGEHUB_STARTUP_ROUNDS` (5) rounds of each; medians. Each round's edgehub log (debug
//! level for edgehub's own events, so each start-up step has a timestamp) is kept as
//! `target/bench/startup-<what>-<round>.log`, for reading the start path.
//!
//! Prints numbers and `METRIC` lines for `benches/run.sh`; asserts nothing about time.
//! Run: `bash cross/build.sh && cargo bench --bench startup`.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;

use edgehub::cri::{api, labels, CriClient, CriRuntime};
use edgehub_testsupport::FakeApiServer;
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};
use support::{metric, Edge};

const PODS: [&str; 2] = ["telemetry-sv74m", "gateway-v9hb2"];
const IMAGE: &str = "127.0.0.1:5000/busybox:1.0";
/// Every start-up step of edgehub's own, timestamped, and each call to the runtime with its
/// duration; the rest at info.
const LOG: &str = "info,edgehub=debug,edgehub::cri=trace,edgehub::containerd=trace";

fn ready(server: &FakeApiServer, name: &str) -> bool {
    server.get("pods", "vehicle", name).is_some_and(|p| {
        p["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

fn node_ready(server: &FakeApiServer, node: &str) -> bool {
    server.get("nodes", "", node).is_some_and(|n| {
        n["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

/// The recorded pods, bound to `node` under uids of this round.
fn bind_pods(server: &FakeApiServer, node: &str, round: &str) {
    for (i, name) in PODS.iter().enumerate() {
        server.modify("pods", "vehicle", name, |p| {
            p["spec"]["nodeName"] = json!(node);
            p["metadata"]["uid"] = json!(format!("{node}-{round}-{i}"));
        });
    }
}

/// Running containers of the node's pods, created after `since` (unix ns; 0: any).
async fn running_since(cri: &CriClient, node: &str, since: i64) -> usize {
    cri.list_containers(HashMap::from([(
        labels::NODE.to_string(),
        node.to_string(),
    )]))
    .await
    .unwrap_or_default()
    .iter()
    .filter(|c| c.state == api::ContainerState::ContainerRunning as i32)
    .filter(|c| c.created_at > since)
    .count()
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Removes every sandbox of `node` and, when `data` is given, the pods' tmpfs volumes under
/// it (which a reboot takes away).
async fn clean(cri: &CriClient, node: &str, data: Option<&Path>, remove: bool) {
    for sb in cri
        .list_pod_sandbox(HashMap::from([(
            labels::NODE.to_string(),
            node.to_string(),
        )]))
        .await
        .unwrap_or_default()
    {
        let _ = cri.stop_pod_sandbox(&sb.id).await;
        if remove {
            let _ = cri.remove_pod_sandbox(&sb.id).await;
        }
    }
    if let Some(data) = data {
        if let Ok(rd) = std::fs::read_dir(data.join("pods")) {
            for pod in rd.flatten() {
                let _ = edgehub::volumes::remove_pod_dir(&pod.path().join("volumes"));
            }
        }
    }
}

/// Containerd's own work for pods shaped as the recorded ones: per pod a sandbox on the
/// host network, then create and start of two containers in turn; the pods side by side.
async fn containerd_alone(socket: &Path, tag: &str) -> Duration {
    let logs = tempfile::tempdir().expect("tempdir");
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..PODS.len() {
        let c = CriClient::new(socket);
        let logs = logs.path().to_path_buf();
        let tag = tag.to_string();
        tasks.push(tokio::spawn(async move {
            let uid = format!("raw-{tag}-{i}-{}", std::process::id());
            let sb_cfg = common::host_network_sandbox(
                &format!("raw-{tag}-{i}"),
                &uid,
                "bench",
                &logs,
                HashMap::from([("bench".to_string(), "startup-raw".to_string())]),
            );
            let sb = c.run_pod_sandbox(sb_cfg.clone()).await.expect("sandbox");
            let mut ids = Vec::new();
            for (name, cmd) in [
                ("app", "while true; do echo hello; sleep 1; done"),
                ("sidecar", "sleep 100000"),
            ] {
                let cfg = api::ContainerConfig {
                    metadata: Some(api::ContainerMetadata {
                        name: name.into(),
                        attempt: 0,
                    }),
                    image: Some(api::ImageSpec {
                        image: IMAGE.into(),
                        ..Default::default()
                    }),
                    command: vec!["/bin/sh".into(), "-c".into(), cmd.into()],
                    log_path: format!("{name}-{i}.log"),
                    ..Default::default()
                };
                let id = c
                    .create_container(&sb, cfg, sb_cfg.clone())
                    .await
                    .expect("create");
                c.start_container(&id).await.expect("start");
                ids.push(id);
            }
            (sb, ids)
        }));
    }
    let mut made = Vec::new();
    for t in tasks {
        made.push(t.await.expect("containerd task"));
    }
    let took = start.elapsed();
    let c = CriClient::new(socket);
    for (sb, ids) in made {
        for id in ids {
            let _ = c.stop_container(&id, 0).await;
            let _ = c.remove_container(&id).await;
        }
        let _ = c.stop_pod_sandbox(&sb).await;
        let _ = c.remove_pod_sandbox(&sb).await;
    }
    took
}

fn keep_log(e: &Edge, what: &str) {
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    let _ = std::fs::create_dir_all(&out);
    let _ = std::fs::copy(
        e.dir.join("edgehub.log"),
        out.join(format!("startup-{what}.log")),
    );
}

/// The offline power cycle, `rounds` times on one data dir: (edgehub, containerd alone) ms.
async fn power_cycle(bin: &Path, socket: &Path, rounds: usize) -> Vec<(f64, f64)> {
    let server = support::recorded_server().await;
    let node = format!("boot-{}", std::process::id());
    bind_pods(&server, &node, "r");
    let dir = tempfile::tempdir().expect("tempdir");
    let cri = CriClient::new(socket);
    let mut e = Edge::prepare(&server, bin, dir.path(), &node, socket, "");
    e.start(&[("EDGEHUB_LOG", LOG)]);
    let up = support::wait_for(120, || PODS.iter().all(|p| ready(&server, p))).await;
    let mut out = Vec::new();
    if !up {
        println!(
            "  power cycle: pods not Ready after 120 s; see {}",
            dir.path().join("edgehub.log").display()
        );
        return out;
    }
    // Settled: statuses sent, sources and tokens cached.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let data = dir.path().join("data");
    for round in 0..rounds {
        // The power goes: no clean stop, the containers die with the machine.
        if let Some(mut c) = e.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        clean(&cri, &node, Some(&data), false).await;
        server.set_offline(true).await.expect("offline");
        let cut = now_ns();
        let _ = std::fs::remove_file(e.dir.join("edgehub.log"));
        let t = e.start(&[("EDGEHUB_LOG", LOG)]);
        let want = PODS.len() * 2;
        let mut took = None;
        while t.elapsed() < Duration::from_secs(60) {
            if running_since(&cri, &node, cut).await >= want {
                took = Some(t.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let raw = containerd_alone(socket, &format!("pc{round}")).await;
        match took {
            Some(d) => {
                let (eh, rt) = (d.as_secs_f64() * 1000.0, raw.as_secs_f64() * 1000.0);
                println!(
                    "  power cycle {round}: every container running {eh:.0} ms after the exec; containerd alone {rt:.0} ms; edgehub adds {:.0} ms",
                    eh - rt
                );
                out.push((eh, rt));
            }
            None => println!("  power cycle {round}: not every container running after 60 s"),
        }
        keep_log(&e, &format!("power-cycle-{round}"));
        // Back online for the next round's settle.
        server.set_offline(false).await.expect("online");
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    e.stop();
    clean(&cri, &node, Some(&data), true).await;
    out
}

/// Pods bound right after the node is Ready, `rounds` times, each with a fresh edgehub:
/// (edgehub, containerd alone) ms.
async fn after_node_ready(bin: &Path, socket: &Path, rounds: usize) -> Vec<(f64, f64)> {
    let cri = CriClient::new(socket);
    let mut out = Vec::new();
    for round in 0..rounds {
        let server = support::recorded_server().await;
        let node = format!("ready-{round}-{}", std::process::id());
        // The recorded pods are bound to another node until the Node is Ready.
        let dir = tempfile::tempdir().expect("tempdir");
        let mut e = Edge::prepare(&server, bin, dir.path(), &node, socket, "");
        e.start(&[("EDGEHUB_LOG", LOG)]);
        if !support::wait_for(60, || node_ready(&server, &node)).await {
            println!("  after Ready {round}: the Node was not Ready after 60 s");
            continue;
        }
        let t = Instant::now();
        bind_pods(&server, &node, "a");
        let mut took = None;
        while t.elapsed() < Duration::from_secs(60) {
            if PODS.iter().all(|p| ready(&server, p)) {
                took = Some(t.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        e.stop();
        keep_log(&e, &format!("after-node-ready-{round}"));
        clean(&cri, &node, Some(&dir.path().join("data")), true).await;
        let raw = containerd_alone(socket, &format!("nr{round}")).await;
        match took {
            Some(d) => {
                let (eh, rt) = (d.as_secs_f64() * 1000.0, raw.as_secs_f64() * 1000.0);
                println!(
                    "  after Ready {round}: both pods Ready {eh:.0} ms after they were bound; containerd alone {rt:.0} ms; edgehub adds {:.0} ms",
                    eh - rt
                );
                out.push((eh, rt));
            }
            None => println!("  after Ready {round}: the pods were not Ready after 60 s"),
        }
    }
    out
}

fn summary(what: &str, key: &str, v: &[(f64, f64)]) {
    if v.is_empty() {
        return;
    }
    let eh = support::median(v.iter().map(|x| x.0).collect());
    let rt = support::median(v.iter().map(|x| x.1).collect());
    let over = support::median(v.iter().map(|x| x.0 - x.1).collect());
    println!(
        "{what}: median {eh:.0} ms; containerd alone {rt:.0} ms; edgehub adds {over:.0} ms (median of {} rounds' differences)",
        v.len()
    );
    metric(&format!("{key}_ms"), eh, "ms");
    metric(&format!("{key}_containerd_ms"), rt, "ms");
    metric(&format!("{key}_overhead_ms"), over, "ms");
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("start-up benchmark: run with `cargo bench --bench startup` (root, containerd test stack)");
        return;
    }
    let Some(bin) = support::edgehub_bin() else {
        return;
    };
    let rounds: usize = std::env::var("EDGEHUB_STARTUP_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    println!("binary: {}; {rounds} rounds", bin.display());
    let socket = common::cri_stack();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        // Warm up: the image is in containerd, the sandbox image too.
        let _ = containerd_alone(&socket, "warm").await;
        let pc = power_cycle(&bin, &socket, rounds).await;
        summary(
            "offline power cycle, exec -> every container running",
            "power_cycle_running",
            &pc,
        );
        let nr = after_node_ready(&bin, &socket, rounds).await;
        summary(
            "pods bound right after node Ready -> both Ready on the apiserver",
            "pod_ready_after_node_ready",
            &nr,
        );
    });
}
