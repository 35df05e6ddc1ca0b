//! `edgehub controller` at fleet scale: 1000 simulated nodes, 50 of them NotReady, the default
//! budget (10%). Prints how many waves and reconciles the rollout took and which requests the
//! controller made to the apiserver; asserts only what must hold (the budget, the NotReady
//! nodes untouched, everything updated in the end), never a time.
//!
//! `cargo test --release --features controller --test controller_scale -- --nocapture`

#![cfg(feature = "controller")]

mod controller_common;

use controller_common::*;
use edgehub_testsupport::daemonset_sim::{self as sim, DaemonSetSim, SimConfig};
use edgehub_testsupport::{fixture_body, FakeApiServer};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const NODES: usize = 1000;
const NOT_READY: usize = 50;

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn print_requests(server: &FakeApiServer, phase: &str) {
    let by = requests_by_kind(server);
    let total: usize = by.values().sum();
    println!("  apiserver requests by the controller, {phase}: {total}");
    for (k, n) in &by {
        println!("    {n:6}  {k}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_nodes_roll_in_budget_sized_waves() {
    let server = Arc::new(FakeApiServer::start().await.unwrap());
    let name = |i: usize| format!("edge-{i:04}");
    // Every 20th node is NotReady: 50 of 1000, spread over the fleet.
    let not_ready: Vec<String> = (0..NODES).filter(|i| i % 20 == 7).map(name).collect();
    assert_eq!(not_ready.len(), NOT_READY);
    for i in 0..NODES {
        server.apply("nodes", sim::node(&name(i), !not_ready.contains(&name(i))));
    }
    let mut ds = fixture_body("daemonsets_list_as_node")["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["metadata"]["name"] == "gateway")
        .unwrap()
        .clone();
    // No max-unavailable annotation: the default, 10% of 1000 nodes.
    ds["metadata"]["annotations"]
        .as_object_mut()
        .unwrap()
        .remove("apps.openyurt.io/max-unavailable");
    let ds = sim::seed_daemonset(&server, ds, "6c4d5f8b7c");
    let ds_uid = ds["metadata"]["uid"].as_str().unwrap().to_string();
    let sim_cfg = SimConfig {
        ready_after: Duration::from_millis(300),
        terminate_after: Duration::from_millis(100),
        tick: Duration::from_millis(50),
    };
    let simulation = DaemonSetSim::spawn(server.clone(), sim_cfg);
    let dir = tempfile::tempdir().unwrap();
    let kc = admin_kubeconfig(&server, dir.path());
    let t_start = Instant::now();
    // The default Lease timings: the debug-built fake apiserver and stand-in share this VM
    // with the controller, and a 2 s renew deadline is shorter than their worst answers.
    let mut ctl = Controller::start(&kc, "controller-scale", &[]);
    wait_until(120, "the controller leads with synced caches", || {
        ctl.leading()
    })
    .await;
    println!(
        "{NODES} nodes ({NOT_READY} NotReady), {NODES} pods: controller leading with synced caches after {:?}",
        t_start.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    print_requests(&server, "start-up");
    server.clear_log();

    let target = "7d4b9c8f6a";
    let stop = Arc::new(AtomicBool::new(false));
    let max_unavailable = Arc::new(AtomicUsize::new(0));
    let deleting_not_ready = Arc::new(AtomicUsize::new(0));
    {
        let (server, uid) = (server.clone(), ds_uid.clone());
        let (stop, max, del) = (
            stop.clone(),
            max_unavailable.clone(),
            deleting_not_ready.clone(),
        );
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let r = rollout(&server, &uid, target);
                max.fetch_max(r.unavailable_ready, Ordering::Relaxed);
                del.fetch_max(r.deleting_not_ready, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        });
    }
    let reconciles_before = ctl
        .metric("edgehub_controller_reconciles_total{result=\"ok\"}")
        .unwrap_or(0.0);
    let t0 = Instant::now();
    sim::roll(
        &server,
        "vehicle",
        "gateway",
        target,
        sim::set_image("127.0.0.1:5000/busybox:2.0"),
    );
    let ready_nodes = NODES - NOT_READY;
    let every = Duration::from_millis(250);
    wait_until_every(
        600,
        every,
        "every Ready node runs the update revision",
        || rollout(&server, &ds_uid, target).updated == ready_nodes,
    )
    .await;
    let rolled = t0.elapsed();
    let waves1 = waves(&server);
    let reconciles1 = ctl
        .metric("edgehub_controller_reconciles_total{result=\"ok\"}")
        .unwrap_or(0.0)
        - reconciles_before;
    println!(
        "rollout to {ready_nodes} Ready nodes: {} waves {:?}, {reconciles1} reconciles, {rolled:?} wall time (sim: Ready {:?} after create, gone {:?} after delete)",
        waves1.len(),
        waves1,
        sim_cfg.ready_after,
        sim_cfg.terminate_after
    );
    print_requests(&server, "rollout");
    let r = rollout(&server, &ds_uid, target);
    assert_eq!(r.old_not_ready, NOT_READY, "{r:?}");
    assert_eq!(waves1.iter().sum::<usize>(), ready_nodes);
    assert!(waves1.iter().all(|&w| w <= 100), "{waves1:?}");
    assert!(waves1.len() >= ready_nodes.div_ceil(100));
    server.clear_log();

    let t1 = Instant::now();
    for n in &not_ready {
        sim::set_node_ready(&server, n, true);
    }
    wait_until_every(
        300,
        every,
        "the 50 nodes that turned Ready are caught up",
        || rollout(&server, &ds_uid, target).updated == NODES,
    )
    .await;
    let caught_up = t1.elapsed();
    let all = waves(&server);
    println!(
        "{NOT_READY} nodes turned Ready: caught up in waves {:?}, {caught_up:?}",
        &all[waves1.len()..]
    );
    print_requests(&server, "catch-up");
    stop.store(true, Ordering::Relaxed);
    let max = max_unavailable.load(Ordering::Relaxed);
    println!("at most {max} Ready nodes without an available pod at once (budget 100)");
    assert!(max <= 100);
    assert_eq!(deleting_not_ready.load(Ordering::Relaxed), 0);
    assert_eq!(all.iter().sum::<usize>(), NODES);
    if let Some(kib) = rss_kib(ctl.child.id()) {
        println!(
            "controller RSS with {NODES} nodes and pods cached: {:.1} MiB",
            kib as f64 / 1024.0
        );
    }
    println!(
        "stand-in: {} pods created, {} turned Ready, {} removed",
        simulation.stats.pods_created.load(Ordering::Relaxed),
        simulation.stats.pods_ready.load(Ordering::Relaxed),
        simulation.stats.pods_removed.load(Ordering::Relaxed)
    );
    ctl.sigterm();
    assert!(ctl.wait_exit(30).await.success());
}
