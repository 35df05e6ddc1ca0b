//! The offline in-place upgrade, measured (needs root and the containerd test stack):
//! `POST .../upgrade` -> the new container running (the image is on the node, the pod has no
//! probe), beside containerd's own work for the same swap in the same run: create the new
//! container, stop the old one (with the pod's grace period, 5 s at most), start the new one.
//!
//! Then transactions (`upgrade/txn.rs`): install to Verified and a rollback from Verified, each
//! beside containerd's own work, and the flash one transaction of two pods writes.
//!
//! Prints numbers and `METRIC` lines for `benches/run.sh`; asserts nothing about time.
//! Run: `cargo bench --bench upgrade`.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/edge.rs"]
mod edge;
mod support;
#[path = "../tests/common/txn.rs"]
mod txn;
#[path = "upgrade/txn.rs"]
mod txn_bench;

use edgehub::cri::{api, labels, CriClient, CriRuntime};
use std::collections::HashMap;
use std::time::{Duration, Instant};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// POST -> the upgrade's container running, through edgehub.
async fn through_edgehub(round: usize) -> Option<f64> {
    let mut n = edge::node(&format!("bench{round}")).await;
    n.rolled_and_offline().await;
    let t = Instant::now();
    let (code, _) = n.http("POST", &n.upgrade_path());
    if code != 200 {
        println!("  round {round}: POST answered {code}");
        return None;
    }
    let took = loop {
        let up = n.containers().await.into_iter().any(|c| {
            c.state == api::ContainerState::ContainerRunning as i32
                && c.labels.contains_key(labels::UPGRADE_ID)
        });
        if up {
            break t.elapsed();
        }
        if t.elapsed() > Duration::from_secs(60) {
            println!("  round {round}: no new container after 60 s");
            return None;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    n.clean().await;
    Some(took.as_secs_f64() * 1000.0)
}

/// The same swap straight against containerd.
async fn containerd_alone(round: usize) -> f64 {
    let c = CriClient::new(&common::cri_stack());
    let logs = tempfile::tempdir().expect("tempdir");
    let uid = format!("raw-swap-{round}-{}", std::process::id());
    let sb_cfg = common::host_network_sandbox(
        &format!("raw-swap-{round}"),
        &uid,
        "bench",
        logs.path(),
        HashMap::from([("bench".to_string(), "swap".to_string())]),
    );
    let sb = c.run_pod_sandbox(sb_cfg.clone()).await.expect("sandbox");
    let cfg = |image: &str, attempt: u32| api::ContainerConfig {
        metadata: Some(api::ContainerMetadata {
            name: "app".into(),
            attempt,
        }),
        image: Some(api::ImageSpec {
            image: image.into(),
            ..Default::default()
        }),
        log_path: format!("app_{attempt}.log"),
        ..Default::default()
    };
    let old = c
        .create_container(&sb, cfg("127.0.0.1:5000/busybox:1.0", 0), sb_cfg.clone())
        .await
        .expect("create");
    c.start_container(&old).await.expect("start");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t = Instant::now();
    let new = c
        .create_container(&sb, cfg("127.0.0.1:5000/busybox:2.0", 1), sb_cfg.clone())
        .await
        .expect("create");
    c.stop_container(&old, 5).await.expect("stop");
    c.start_container(&new).await.expect("start");
    let took = t.elapsed().as_secs_f64() * 1000.0;
    let _ = c.stop_pod_sandbox(&sb).await;
    let _ = c.remove_pod_sandbox(&sb).await;
    took
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("upgrade benchmark: run with `cargo bench --bench upgrade` (root, containerd test stack)");
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        // Both images on the node first: containerd's swap below does not pull, and the full
        // run (2026-12-04) found busybox:2.0 gone from containerd by the time this bench ran.
        let c = CriClient::new(&common::cri_stack());
        for image in ["127.0.0.1:5000/busybox:1.0", "127.0.0.1:5000/busybox:2.0"] {
            c.pull_image(image, None).await.expect("pull");
        }
        let _ = containerd_alone(99).await; // warm-up
        let (mut eh, mut raw) = (Vec::new(), Vec::new());
        for round in 0..5 {
            if let Some(ms) = through_edgehub(round).await {
                eh.push(ms);
            }
            raw.push(containerd_alone(round).await);
        }
        if eh.is_empty() {
            println!("no upgrade completed");
            return;
        }
        let (e, r) = (median(eh.clone()), median(raw.clone()));
        println!(
            "offline in-place upgrade, POST -> new container running: median {e:.0} ms over {} (all: {eh:.0?}); containerd's own create + stop + start: {r:.0} ms (all: {raw:.0?}); edgehub adds {:.0} ms (budget 300 ms)",
            eh.len(),
            e - r
        );
        support::metric("upgrade_ms", e, "ms");
        support::metric("upgrade_containerd_ms", r, "ms");
        support::metric("upgrade_overhead_ms", e - r, "ms");
        txn_bench::run().await;
    });
}
