//! Transactions, measured (part of `cargo bench --bench upgrade`): install to Verified and a
//! rollback from Verified to the old revision ready, each beside containerd's own work for the
//! same steps in the same run, and the flash one transaction of two pods writes.
//!
//! Times come from the journal edgehub writes (when the request was made, when each state was
//! entered, when the decision was written), not from polling, so they hold what edgehub did and
//! nothing of the bench's own looking.

use crate::edge::{self, Node};
use crate::{common, support, txn};
use edgehub::cri::{api, CriClient, CriRuntime};
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

const POD: &str = "vehicle/telemetry-sv74m";

/// The wall-clock ms of a request's making and of each state it entered.
fn journal(db: &Path, request: i64) -> (i64, HashMap<String, i64>) {
    let c = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .expect("the database");
    let created: i64 = c
        .query_row(
            "SELECT created_ms FROM requests WHERE id = ?1",
            [request],
            |r| r.get(0),
        )
        .expect("the request");
    let mut stmt = c
        .prepare("SELECT state, at_ms FROM request_log WHERE request_id = ?1")
        .unwrap();
    let states = stmt
        .query_map([request], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .filter_map(Result::ok)
        .collect();
    (created, states)
}

/// When the transaction's decision was written (wall-clock ms).
fn decided_at(db: &Path, id: &str) -> i64 {
    let c = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .expect("the database");
    c.query_row(
        "SELECT updated_ms FROM transactions WHERE id = ?1",
        [id],
        |r| r.get(0),
    )
    .expect("the transaction")
}

/// A node whose new containers need not hold (min_ready_floor 0): what is left between the
/// request and Verified is edgehub's work and containerd's.
async fn quick_node(tag: &str) -> Node {
    let n = edge::node(tag).await;
    n.edit_config(|c| c.replace("[upgrade]\n", "[upgrade]\nmin_ready_floor_secs = 0\n"));
    n
}

/// One round through edgehub: (install ms, rollback ms).
async fn round(i: usize) -> Option<(f64, f64)> {
    let mut n = quick_node(&format!("btx{i}")).await;
    n.rolled_and_offline().await;
    let (id, ran) = txn::start(&n, &[POD], &[]).await;
    let Some(id) = id else {
        println!("  round {i}: refused: {}", ran.stderr.trim());
        return None;
    };
    let t = txn::wait(&n, &id, 60, &["Verified", "RolledBack", "Failed"]).await;
    if t["state"] != "Verified" {
        println!("  round {i}: ended {}", t["state"]);
        return None;
    }
    let request = t["pods"][0]["request"].as_i64().unwrap();
    let ran = txn::cli(&n, &["rollback", &id, "--reason", "bench"]).await;
    if !ran.ok {
        println!("  round {i}: rollback failed: {}", ran.stderr.trim());
        return None;
    }
    let (created, states) = journal(&n.db(), request);
    let install = (states["Verified"] - created) as f64;
    let rollback = (states["RolledBack"] - decided_at(&n.db(), &id)) as f64;
    n.clean().await;
    Some((install, rollback))
}

fn app(image: &str, attempt: u32) -> api::ContainerConfig {
    api::ContainerConfig {
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
    }
}

/// containerd's own work for the same steps: install (create the new container, stop the old
/// one with the pod's 5 s grace, start the new one, one exec readiness probe), and rollback
/// (stop the new one with the grace, remove it, create and start the old spec again, one exec
/// probe). In ms.
async fn containerd_alone(i: usize) -> (f64, f64) {
    let c = CriClient::new(&common::cri_stack());
    let logs = tempfile::tempdir().expect("tempdir");
    let uid = format!("raw-txn-{i}-{}", std::process::id());
    let sb_cfg = common::host_network_sandbox(
        &format!("raw-txn-{i}"),
        &uid,
        "bench",
        logs.path(),
        HashMap::from([("bench".to_string(), "txn".to_string())]),
    );
    let sb = c.run_pod_sandbox(sb_cfg.clone()).await.expect("sandbox");
    let probe = |id: String| {
        let c = c.clone();
        async move {
            c.exec_sync(&id, vec!["/bin/true".into()], Duration::from_secs(1))
                .await
                .expect("probe")
        }
    };
    let old = c
        .create_container(&sb, app("127.0.0.1:5000/busybox:1.0", 0), sb_cfg.clone())
        .await
        .expect("create");
    c.start_container(&old).await.expect("start");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t = Instant::now();
    let new = c
        .create_container(&sb, app("127.0.0.1:5000/busybox:2.0", 1), sb_cfg.clone())
        .await
        .expect("create");
    c.stop_container(&old, 5).await.expect("stop");
    c.start_container(&new).await.expect("start");
    probe(new.clone()).await;
    let install = t.elapsed().as_secs_f64() * 1000.0;
    let t = Instant::now();
    c.stop_container(&new, 5).await.expect("stop");
    c.remove_container(&new).await.expect("remove");
    c.remove_container(&old).await.expect("remove");
    let back = c
        .create_container(&sb, app("127.0.0.1:5000/busybox:1.0", 2), sb_cfg.clone())
        .await
        .expect("create");
    c.start_container(&back).await.expect("start");
    probe(back).await;
    let rollback = t.elapsed().as_secs_f64() * 1000.0;
    let _ = c.stop_pod_sandbox(&sb).await;
    let _ = c.remove_pod_sandbox(&sb).await;
    (install, rollback)
}

/// What the edgehub process wrote (`write_bytes`) for one transaction of two pods, from the
/// request to Committed, less what it writes idle over as long.
async fn flash_of_two_pods() -> Option<(u64, f64)> {
    let mut n = quick_node("btxflash").await;
    txn::add_gateway(&n, "127.0.0.1:5000/busybox:2.0");
    n.rolled_and_offline().await;
    let pid = n.child.as_ref()?.id();
    // Idle first: the background over a window as long as the transaction will take.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle_start = (support::io_write_bytes(pid)?, Instant::now());
    tokio::time::sleep(Duration::from_secs(10)).await;
    let idle_rate = (support::io_write_bytes(pid)? - idle_start.0) as f64
        / idle_start.1.elapsed().as_secs_f64();
    let before = (support::io_write_bytes(pid)?, Instant::now());
    let (id, ran) = txn::start(&n, &[POD, "vehicle/gateway-v9hb2"], &["--wait"]).await;
    let Some(id) = id.filter(|_| ran.ok) else {
        println!(
            "  flash: the transaction did not reach Verified: {}",
            ran.stderr.trim()
        );
        return None;
    };
    let ran = txn::cli(&n, &["commit", &id]).await;
    if !ran.ok {
        println!("  flash: the commit failed: {}", ran.stderr.trim());
        return None;
    }
    let written = support::io_write_bytes(pid)? - before.0;
    let secs = before.1.elapsed().as_secs_f64();
    let net = written.saturating_sub((idle_rate * secs) as u64);
    n.clean().await;
    Some((net, secs))
}

pub async fn run() {
    let _ = containerd_alone(99).await; // warm-up
    let (mut install, mut rollback, mut raw_i, mut raw_r) = (vec![], vec![], vec![], vec![]);
    for i in 0..5 {
        if let Some((a, b)) = round(i).await {
            install.push(a);
            rollback.push(b);
        }
        let (a, b) = containerd_alone(i).await;
        raw_i.push(a);
        raw_r.push(b);
    }
    if install.is_empty() {
        println!("no transaction reached Verified");
        return;
    }
    let m = crate::median;
    let (i, ri, r, rr) = (
        m(install.clone()),
        m(raw_i.clone()),
        m(rollback.clone()),
        m(raw_r.clone()),
    );
    println!(
        "transaction of one pod, request -> Verified: median {i:.0} ms (all: {install:.0?}); containerd's own create + stop + start + probe: {ri:.0} ms (all: {raw_i:.0?}); edgehub adds {:.0} ms per pod (budget 300 ms)",
        i - ri
    );
    println!(
        "rollback from Verified, decision -> old revision ready: median {r:.0} ms (all: {rollback:.0?}); containerd's own stop + remove + create + start + probe: {rr:.0} ms (all: {raw_r:.0?}); edgehub adds {:.0} ms (budget 500 ms)",
        r - rr
    );
    support::metric("txn_install_overhead_ms", i - ri, "ms");
    support::metric("txn_rollback_overhead_ms", r - rr, "ms");
    match flash_of_two_pods().await {
        Some((bytes, secs)) => {
            println!(
                "flash written by one transaction of two pods (request -> Committed, {secs:.1} s, idle background subtracted): {bytes} B"
            );
            support::metric("txn_flash_write_bytes_two_pods", bytes as f64, "B");
        }
        None => println!("flash: not measured"),
    }
}
