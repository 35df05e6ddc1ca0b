//! `edgehub controller` end to end: the binary (built with feature `controller`) against the
//! fake apiserver over TLS, with the DaemonSet-controller and kubelet stand-in of
//! `edgehub_testsupport::daemonset_sim` playing the rest of the cluster.

#![cfg(feature = "controller")]

mod controller_common;

use controller_common::*;
use edgehub_testsupport::daemonset_sim::{self as sim, DaemonSetSim, SimConfig};
use edgehub_testsupport::{fixture_body, FakeApiServer};
use serde_json::Value;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn recorded_daemonset(name: &str) -> Value {
    fixture_body("daemonsets_list_as_node")["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["metadata"]["name"] == name)
        .unwrap()
        .clone()
}

fn uid(v: &Value) -> String {
    v["metadata"]["uid"].as_str().unwrap().to_string()
}

/// Samples the rollout every 10 ms in the background and keeps the worst unavailability seen
/// on Ready nodes, and whether a pod on a NotReady node was ever being deleted.
struct Sampler {
    stop: Arc<AtomicBool>,
    max_unavailable: Arc<AtomicUsize>,
    deleting_not_ready: Arc<AtomicUsize>,
}

impl Sampler {
    fn spawn(server: Arc<FakeApiServer>, uid: String, hash: String) -> Sampler {
        let s = Sampler {
            stop: Arc::new(AtomicBool::new(false)),
            max_unavailable: Arc::new(AtomicUsize::new(0)),
            deleting_not_ready: Arc::new(AtomicUsize::new(0)),
        };
        let (stop, max, del) = (
            s.stop.clone(),
            s.max_unavailable.clone(),
            s.deleting_not_ready.clone(),
        );
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let r = rollout(&server, &uid, &hash);
                max.fetch_max(r.unavailable_ready, Ordering::Relaxed);
                del.fetch_max(r.deleting_not_ready, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        s
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advanced_rolling_update_rolls_ready_nodes_in_waves_and_catches_up_not_ready_ones() {
    let server = Arc::new(FakeApiServer::start().await.unwrap());
    let not_ready = ["edge-02", "edge-05", "edge-08"];
    let nodes: Vec<String> = (0..10).map(|i| format!("edge-{i:02}")).collect();
    for n in &nodes {
        server.apply("nodes", sim::node(n, !not_ready.contains(&n.as_str())));
    }
    // The recorded gateway DaemonSet: AdvancedRollingUpdate, max-unavailable 30%, OnDelete.
    let ds = sim::seed_daemonset(&server, recorded_daemonset("gateway"), "6c4d5f8b7c");
    let ds_uid = uid(&ds);
    let _sim = DaemonSetSim::spawn(server.clone(), SimConfig::default());
    let dir = tempfile::tempdir().unwrap();
    let kc = admin_kubeconfig(&server, dir.path());
    let mut ctl = Controller::start(&kc, "controller-a", &[]);
    wait_until(60, "the controller leads with synced caches", || {
        ctl.leading()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        server.count(|r| r.method == "DELETE"),
        0,
        "nothing to do while every pod runs the update revision"
    );

    let target = "7d4b9c8f6a";
    let t0 = Instant::now();
    sim::roll(
        &server,
        "vehicle",
        "gateway",
        target,
        sim::set_image("127.0.0.1:5000/busybox:2.0"),
    );
    let sampler = Sampler::spawn(server.clone(), ds_uid.clone(), target.into());
    wait_until(60, "the 7 Ready nodes run the update revision", || {
        rollout(&server, &ds_uid, target).updated == 7
    })
    .await;
    let ready_time = t0.elapsed();
    let r = rollout(&server, &ds_uid, target);
    assert_eq!(r.old_not_ready, 3, "NotReady nodes are not touched: {r:?}");
    let first = waves(&server);
    println!("10 nodes, 3 NotReady, max-unavailable 30%: waves {first:?}, 7 Ready nodes updated in {ready_time:?}");
    assert_eq!(first.iter().sum::<usize>(), 7, "{first:?}");
    assert_eq!(
        first[0], 3,
        "the first wave spends the whole budget: {first:?}"
    );
    assert!(first.iter().all(|&w| w <= 3), "{first:?}");
    assert!(first.len() >= 3, "{first:?}");

    // The three nodes come back: the Node watch alone triggers it (resync is an hour).
    let t1 = Instant::now();
    for n in not_ready {
        sim::set_node_ready(&server, n, true);
    }
    wait_until(60, "all 10 nodes run the update revision", || {
        rollout(&server, &ds_uid, target).updated == 10
    })
    .await;
    let catch_up = t1.elapsed();
    let all = waves(&server);
    println!(
        "3 nodes turned Ready: caught up in waves {:?} within {catch_up:?}",
        &all[first.len()..]
    );
    assert_eq!(all.iter().sum::<usize>(), 10);
    assert!(all.iter().all(|&w| w <= 3), "{all:?}");
    let max = sampler.max_unavailable.load(Ordering::Relaxed);
    println!("at most {max} Ready node(s) were without an available pod at once (budget 3)");
    assert!(max <= 3, "the budget was overspent: {max} unavailable");
    assert_eq!(sampler.deleting_not_ready.load(Ordering::Relaxed), 0);
    drop(sampler);

    let deleted_budget = ctl
        .metric("edgehub_controller_pods_deleted_total{why=\"budget\"}")
        .unwrap();
    let deleted_free = ctl
        .metric("edgehub_controller_pods_deleted_total{why=\"unavailable\"}")
        .unwrap();
    assert_eq!(deleted_budget + deleted_free, 10.0);
    assert_eq!(
        ctl.metric("edgehub_controller_waves_total"),
        Some(all.len() as f64)
    );
    // Every deletion carried the uid precondition and no pod was deleted twice.
    assert_eq!(server.count(|r| r.method == "DELETE"), 10);

    assert_deploy_rbac_allows_every_request(&server);

    // Graceful shutdown: exit 0 and the Lease released for a standby.
    ctl.sigterm();
    assert!(ctl.wait_exit(20).await.success());
    let lease = server
        .get("leases", "kube-system", "edgehub-controller")
        .unwrap();
    assert!(lease["spec"]["holderIdentity"].is_null(), "{lease}");
}

/// The PodNeedUpgrade condition of a pod: (status, message).
fn need_upgrade(pod: &Value) -> Option<(String, String)> {
    pod["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "PodNeedUpgrade")
        .map(|c| {
            (
                c["status"].as_str().unwrap_or("").to_string(),
                c["message"].as_str().unwrap_or("").to_string(),
            )
        })
}

fn conditions_of(server: &FakeApiServer, ds_uid: &str) -> Vec<Option<(String, String)>> {
    live_pods_by_node(server, ds_uid)
        .iter()
        .map(|(_, p)| need_upgrade(p))
        .collect()
}

fn status_patches(server: &FakeApiServer) -> usize {
    server.count(|r| r.method == "PATCH" && r.path.ends_with("/status"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ota_gets_pod_need_upgrade_written_only_on_change_and_other_daemonsets_are_left_alone() {
    let server = Arc::new(FakeApiServer::start().await.unwrap());
    for n in ["edge-1", "edge-2", "edge-3"] {
        server.apply("nodes", sim::node(n, true));
    }
    // The recorded OTA DaemonSet, and the gateway turned into a RollingUpdate DaemonSet: its
    // annotation alone does not opt it in.
    let ota = sim::seed_daemonset(&server, recorded_daemonset("telemetry"), "768bcc7446");
    let mut gateway = recorded_daemonset("gateway");
    gateway["spec"]["updateStrategy"] = serde_json::json!({"type": "RollingUpdate"});
    let gateway = sim::seed_daemonset(&server, gateway, "6c4d5f8b7c");
    let _sim = DaemonSetSim::spawn(server.clone(), SimConfig::default());
    let dir = tempfile::tempdir().unwrap();
    let kc = admin_kubeconfig(&server, dir.path());
    let ctl = Controller::start(&kc, "controller-a", &[]);
    wait_until(60, "the controller leads", || ctl.leading()).await;

    // Every pod is at the update revision: False, naming it.
    let latest = Some((
        "False".to_string(),
        "controllerrevision: 768bcc7446".to_string(),
    ));
    wait_until(30, "PodNeedUpgrade False on the 3 OTA pods", || {
        conditions_of(&server, &uid(&ota)) == vec![latest.clone(); 3]
    })
    .await;
    // The fake logs a request after answering it: wait for the log to catch up.
    wait_until(10, "3 status patches logged", || {
        status_patches(&server) == 3
    })
    .await;

    // The operator rolls both; the hash is the one the real DaemonSet controller recorded.
    sim::roll(
        &server,
        "vehicle",
        "telemetry",
        "55778fbb9f",
        sim::set_image("127.0.0.1:5000/busybox:2.0"),
    );
    sim::roll(
        &server,
        "vehicle",
        "gateway",
        "5f6d7c8b9a",
        sim::set_image("127.0.0.1:5000/busybox:2.0"),
    );
    let needed = Some((
        "True".to_string(),
        "controllerrevision: 55778fbb9f".to_string(),
    ));
    wait_until(30, "PodNeedUpgrade True on the 3 OTA pods", || {
        conditions_of(&server, &uid(&ota)) == vec![needed.clone(); 3]
    })
    .await;
    wait_until(10, "6 status patches logged", || {
        status_patches(&server) == 6
    })
    .await;
    // The strategic merge patch kept the kubelet's conditions.
    for (_, p) in live_pods_by_node(&server, &uid(&ota)) {
        assert!(sim::is_ready(&p), "{p}");
    }

    // The device upgrades one pod by delete-and-adopt; its replacement is at the update
    // revision and gets False. Nothing else is written.
    let (_, victim) = live_pods_by_node(&server, &uid(&ota)).remove(0);
    server.remove(
        "pods",
        "vehicle",
        victim["metadata"]["name"].as_str().unwrap(),
    );
    wait_until(30, "the replacement gets PodNeedUpgrade False", || {
        let c = conditions_of(&server, &uid(&ota));
        c.len() == 3
            && c.iter()
                .filter(|c| {
                    c.as_ref()
                        .is_some_and(|(s, m)| s == "False" && m.ends_with("55778fbb9f"))
                })
                .count()
                == 1
    })
    .await;
    // An unrelated change to the DaemonSet reconciles it again: no write, as nothing changed.
    server.modify("daemonsets", "vehicle", "telemetry", |d| {
        d["metadata"]["labels"] = serde_json::json!({"touched": "yes"});
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    // 3 False, 3 True, 1 False for the replacement (created Pending, then Ready: the kubelet
    // stand-in keeps the condition, so it is not rewritten).
    assert_eq!(status_patches(&server), 7);

    // No deletions at all; the RollingUpdate DaemonSet's pods got no condition.
    assert_eq!(
        server.count(|r| r.method == "DELETE" && r.user.as_deref() == Some("admin")),
        0
    );
    assert!(conditions_of(&server, &uid(&gateway))
        .iter()
        .all(Option::is_none));
    let evs = events(&server, "PodNeedUpgrade");
    assert_eq!(evs.len(), 1, "{evs:?}");
    assert!(
        evs[0].contains("True on 3 pod(s) for controllerrevision 55778fbb9f"),
        "{evs:?}"
    );
    println!("controller requests: {:#?}", requests_by_kind(&server));
    assert_deploy_rbac_allows_every_request(&server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_the_lease_when_the_leader_stops_or_dies() {
    let server = Arc::new(FakeApiServer::start().await.unwrap());
    server.apply("nodes", sim::node("edge-1", true));
    sim::seed_daemonset(&server, recorded_daemonset("telemetry"), "768bcc7446");
    let dir = tempfile::tempdir().unwrap();
    let kc = admin_kubeconfig(&server, dir.path());
    let holder = || {
        server
            .get("leases", "kube-system", "edgehub-controller")
            .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_string))
    };

    let mut a = Controller::start_fast_lease(&kc, "replica-a");
    wait_until(30, "replica-a leads", || a.leading()).await;
    let b = Controller::start_fast_lease(&kc, "replica-b");
    // A standby is ready (it is doing its job) but does not lead.
    wait_until(30, "replica-b answers as a standby", || {
        b.get("/readyz").is_some_and(|(c, _)| c == 200)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(b.metric("edgehub_controller_leader"), Some(0.0));
    assert_eq!(holder().as_deref(), Some("replica-a"));

    // SIGTERM: a releases the Lease and b takes it without waiting for it to expire.
    let t = Instant::now();
    a.sigterm();
    assert!(a.wait_exit(20).await.success());
    wait_until(20, "replica-b leads after a released", || b.leading()).await;
    println!("takeover after a graceful stop: {:?}", t.elapsed());
    assert_eq!(holder().as_deref(), Some("replica-b"));

    // SIGKILL: nothing is released; c takes over once the 6 s Lease has gone unrenewed.
    let mut b = b;
    let c = Controller::start_fast_lease(&kc, "replica-c");
    wait_until(30, "replica-c answers as a standby", || {
        c.get("/readyz").is_some_and(|(code, _)| code == 200)
    })
    .await;
    let t = Instant::now();
    let _ = b.child.kill();
    let _ = b.child.wait();
    wait_until(30, "replica-c leads after b died", || c.leading()).await;
    println!("takeover after SIGKILL of the leader: {:?}", t.elapsed());
    assert_eq!(holder().as_deref(), Some("replica-c"));
    let transitions = server
        .get("leases", "kube-system", "edgehub-controller")
        .unwrap()["spec"]["leaseTransitions"]
        .as_i64();
    assert_eq!(transitions, Some(2));
    assert_deploy_rbac_allows_every_request(&server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_delete_and_dropped_watches_are_survived_within_the_budget() {
    let server = Arc::new(FakeApiServer::start().await.unwrap());
    for i in 0..4 {
        server.apply("nodes", sim::node(&format!("edge-{i}"), true));
    }
    let mut gw = recorded_daemonset("gateway");
    gw["metadata"]["annotations"]["apps.openyurt.io/max-unavailable"] = "1".into();
    let ds = sim::seed_daemonset(&server, gw, "6c4d5f8b7c");
    let ds_uid = uid(&ds);
    // A second DaemonSet whose budget cannot be read: a Warning, and nothing deleted.
    let mut bad = recorded_daemonset("gateway");
    bad["metadata"]["name"] = "bad-budget".into();
    bad["metadata"]["uid"] = "0b0b0b0b-0000-4000-8000-000000000001".into();
    bad["metadata"]["annotations"]["apps.openyurt.io/max-unavailable"] = "lots".into();
    sim::seed_daemonset(&server, bad, "1a2b3c4d5e");
    let _sim = DaemonSetSim::spawn(server.clone(), SimConfig::default());
    let dir = tempfile::tempdir().unwrap();
    let kc = admin_kubeconfig(&server, dir.path());
    let ctl = Controller::start(&kc, "controller-a", &[]);
    wait_until(60, "the controller leads", || ctl.leading()).await;

    // The first pod deletion gets a 500 (pods are deleted by name in their namespace; the
    // watches use the cluster-wide path).
    server.fail_next(1, 500, None, &["/namespaces/vehicle/pods/"]);
    let target = "7d4b9c8f6a";
    sim::roll(
        &server,
        "vehicle",
        "bad-budget",
        "9f8e7d6c5b",
        sim::set_image("x:2"),
    );
    sim::roll(&server, "vehicle", "gateway", target, sim::set_image("x:2"));
    let sampler = Sampler::spawn(server.clone(), ds_uid.clone(), target.into());
    wait_until(30, "the failed delete is reported", || {
        !events(&server, "FailedDelete").is_empty()
    })
    .await;
    // Every watch is cut once mid-rollout: the reflectors resume and the rollout goes on.
    wait_until(30, "a first pod replaced", || {
        rollout(&server, &ds_uid, target).updated >= 1
    })
    .await;
    server.drop_connections();
    wait_until(60, "all 4 nodes run the update revision", || {
        rollout(&server, &ds_uid, target).updated == 4
    })
    .await;
    let max = sampler.max_unavailable.load(Ordering::Relaxed);
    assert!(max <= 1, "budget 1 overspent: {max}");
    // At least the injected failure (cutting the connections may fail a request in flight).
    assert!(ctl
        .metric("edgehub_controller_pod_delete_errors_total")
        .is_some_and(|n| n >= 1.0));
    assert_eq!(waves(&server), vec![1, 1, 1, 1]);
    let warnings = events(&server, "InvalidMaxUnavailable");
    assert_eq!(warnings.len(), 1, "warned once: {warnings:?}");
    assert!(warnings[0].contains("\"lots\""), "{warnings:?}");
    // Nothing of bad-budget was deleted: its four pods are the seeded ones, at its old hash.
    let bad_pods = live_pods_by_node(&server, "0b0b0b0b-0000-4000-8000-000000000001");
    assert_eq!(bad_pods.len(), 4);
    assert!(bad_pods
        .iter()
        .all(|(_, p)| p["metadata"]["labels"]["controller-revision-hash"] == "1a2b3c4d5e"));
    assert_deploy_rbac_allows_every_request(&server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_cannot_renew_stops_before_its_lease_expires() {
    let server = Arc::new(FakeApiServer::start().await.unwrap());
    server.apply("nodes", sim::node("edge-1", true));
    sim::seed_daemonset(&server, recorded_daemonset("telemetry"), "768bcc7446");
    let dir = tempfile::tempdir().unwrap();
    let kc = admin_kubeconfig(&server, dir.path());
    let mut ctl = Controller::start_fast_lease(&kc, "replica-a");
    wait_until(30, "replica-a leads", || ctl.leading()).await;
    // The apiserver stops answering this replica: its renewals hang. With a 6 s Lease and a
    // 4 s renew deadline it must give up leading (and exit non-zero, for its Deployment to
    // restart it) without waiting for a request timeout.
    let t = Instant::now();
    server.stall(true);
    let status = ctl.wait_exit(30).await;
    let after = t.elapsed();
    server.stall(false);
    println!("a stalled leader exited after {after:?} with {status}");
    assert!(!status.success());
}
