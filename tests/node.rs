//! Node registration, status and Lease against the fake apiserver, with NodeRestriction as the
//! fixtures recorded it.

mod common;

use common::{test_config, wait_until};
use edgehub::config::{Config, Overrides};
use edgehub::link::LinkState;
use edgehub::node::{NodeAgent, NodeProbe, NodeSample};
use edgehub_testsupport::{fixture_body, FakeApiServer, NODE_TOKEN};
use serde_json::Value;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A device whose readings the test controls.
#[derive(Default)]
struct Probe(Mutex<NodeSample>);

impl NodeProbe for Probe {
    fn sample(&self) -> NodeSample {
        self.0.lock().unwrap().clone()
    }
}

fn device() -> Arc<Probe> {
    Arc::new(Probe(Mutex::new(NodeSample {
        cpus: 4,
        memory_total_bytes: 3906 << 20,
        memory_available_bytes: 2000 << 20,
        disk_free_percent: Some(60),
        pids_used: 200,
        pid_max: 32768,
        internal_ip: Some("127.0.0.1".parse().unwrap()),
        kernel_version: "6.1.0".into(),
        os_image: "Poky (Yocto Project Reference Distro)".into(),
        architecture: "arm64".into(),
        container_runtime_version: Some("containerd://1.6.20".into()),
        ..Default::default()
    })))
}

struct Env {
    server: FakeApiServer,
    _dir: tempfile::TempDir,
    config: Config,
}

async fn env(node_toml: &str) -> Env {
    let server = FakeApiServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kc = server
        .write_kubeconfig(&dir.path().join("kube"), NODE_TOKEN)
        .unwrap();
    let mut config = test_config(&dir.path().join("data"), &kc);
    let node = Config::resolve(
        Some(node_toml),
        std::path::Path::new("t"),
        &[],
        &Overrides::default(),
        Some("edge-1".into()),
    )
    .unwrap()
    .node;
    config.node = node;
    Env {
        server,
        _dir: dir,
        config,
    }
}

fn agent(e: &Env, probe: Arc<Probe>) -> NodeAgent {
    NodeAgent::new(
        common::client(&e.config),
        probe,
        e.config.node.clone(),
        "edge-1".into(),
    )
}

fn spawn(
    a: NodeAgent,
    link: tokio::sync::watch::Receiver<LinkState>,
) -> tokio::sync::watch::Sender<bool> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(a.run(link, rx));
    tx
}

fn condition<'a>(node: &'a Value, kind: &str) -> &'a Value {
    node["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == kind)
        .unwrap()
}

const FAST: &str = "[node]\nlease_renew_secs = 1\nmax_pods = 32\nlabels = { \"openyurt.io/is-edge-worker\" = \"true\" }\n";

#[tokio::test]
async fn registers_the_node_with_what_a_scheduler_needs_and_keeps_the_lease_fresh() {
    let e = env(FAST).await;
    let a = agent(&e, device());
    let stats = a.stats.clone();
    let (_link_tx, link) = tokio::sync::watch::channel(LinkState::Online);
    let _stop = spawn(a, link);
    wait_until(10, "the Node is registered", || {
        e.server.get("nodes", "", "edge-1").is_some()
    })
    .await;
    wait_until(10, "the first status patch", || {
        stats.status_patches.load(Ordering::Relaxed) >= 1
    })
    .await;

    let node = e.server.get("nodes", "", "edge-1").unwrap();
    let recorded = fixture_body("node_get_self");
    let keys = |v: &Value| -> Vec<String> {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    for field in ["capacity", "allocatable", "nodeInfo"] {
        assert_eq!(
            keys(&node["status"][field]),
            keys(&recorded["status"][field]),
            "status.{field}"
        );
    }
    assert_eq!(condition(&node, "Ready")["status"], "True");
    assert_eq!(
        condition(&node, "Ready")["reason"],
        recorded["status"]["conditions"][0]["reason"]
    );
    assert_eq!(node["status"]["allocatable"]["pods"], "32");
    assert_eq!(node["status"]["addresses"], recorded["status"]["addresses"]);
    for l in [
        "kubernetes.io/hostname",
        "kubernetes.io/os",
        "kubernetes.io/arch",
        "openyurt.io/is-edge-worker",
    ] {
        assert_eq!(
            node["metadata"]["labels"][l], recorded["metadata"]["labels"][l],
            "{l}"
        );
    }
    assert!(
        node["spec"].get("taints").is_none(),
        "no taints a DaemonSet would have to tolerate"
    );
    assert!(
        e.server
            .count(|r| r.method == "POST" && r.path == "/api/v1/nodes" && r.status == 201)
            == 1
    );

    // The Lease is created, then renewed every second, and nothing is written more often.
    wait_until(10, "three lease renewals", || {
        stats.lease_renewals.load(Ordering::Relaxed) >= 3
    })
    .await;
    let l1 = e.server.get("leases", "kube-node-lease", "edge-1").unwrap();
    assert_eq!(l1["spec"]["holderIdentity"], "edge-1");
    assert_eq!(l1["spec"]["leaseDurationSeconds"], 40);
    let t1 = l1["spec"]["renewTime"].as_str().unwrap().to_string();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let t2 = e.server.get("leases", "kube-node-lease", "edge-1").unwrap()["spec"]["renewTime"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(t2 > t1, "renewTime advances: {t1} -> {t2}");
    // Status is not re-sent while nothing changes (the report interval is 5 minutes).
    assert_eq!(
        e.server.count(|r| r.path.ends_with("/nodes/edge-1/status")),
        1
    );
}

#[tokio::test]
async fn an_existing_node_is_reconciled_not_recreated() {
    let e = env(FAST).await;
    e.server.apply("nodes", fixture_body("node_get_self"));
    e.server.modify("nodes", "", "edge-1", |n| {
        n["metadata"]["labels"]
            .as_object_mut()
            .unwrap()
            .remove("openyurt.io/is-edge-worker");
    });
    let a = agent(&e, device());
    let stats = a.stats.clone();
    let (_l, link) = tokio::sync::watch::channel(LinkState::Online);
    let _stop = spawn(a, link);
    wait_until(10, "registered", || {
        stats.registrations.load(Ordering::Relaxed) >= 1
    })
    .await;
    wait_until(10, "the label is put back", || {
        e.server.get("nodes", "", "edge-1").unwrap()["metadata"]["labels"]
            ["openyurt.io/is-edge-worker"]
            == "true"
    })
    .await;
    assert_eq!(
        e.server
            .count(|r| r.method == "POST" && r.path == "/api/v1/nodes"),
        0
    );
}

#[tokio::test]
async fn a_forbidden_label_is_refused_before_any_request() {
    let server = FakeApiServer::start().await.unwrap();
    let err = Config::resolve(
        Some("[node]\nlabels = { \"node-role.kubernetes.io/edge\" = \"\" }\n"),
        std::path::Path::new("/etc/edgehub/config.toml"),
        &[],
        &Overrides::default(),
        Some("edge-1".into()),
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("node.labels") && msg.contains("NodeRestriction"),
        "{msg}"
    );
    assert!(server.requests().is_empty());
    // What the apiserver would have said (fixture): 403 for the same label.
    assert_eq!(
        edgehub_testsupport::fixture("node_create_forbidden_label")["response"]["status"],
        403
    );
}

#[tokio::test]
async fn a_lease_conflict_is_reread_and_retried() {
    let e = env(FAST).await;
    let a = agent(&e, device());
    let stats = a.stats.clone();
    let (_l, link) = tokio::sync::watch::channel(LinkState::Online);
    let _stop = spawn(a, link);
    wait_until(10, "the lease exists", || {
        e.server
            .get("leases", "kube-node-lease", "edge-1")
            .is_some()
    })
    .await;
    // Another writer bumps the Lease: edgehub's next PUT carries a stale resourceVersion.
    e.server.modify("leases", "kube-node-lease", "edge-1", |l| {
        l["metadata"]["annotations"] = serde_json::json!({"someone": "else"});
    });
    let renewals = stats.lease_renewals.load(Ordering::Relaxed);
    wait_until(10, "a 409 on the lease", || {
        e.server
            .count(|r| r.method == "PUT" && r.path.ends_with("/leases/edge-1") && r.status == 409)
            >= 1
    })
    .await;
    // After the 409: a reread, then a successful renewal (waited for in the server's log, so
    // a renewal already in flight before the conflict cannot satisfy it).
    let after_conflict = || -> Vec<(String, u16)> {
        let log: Vec<_> = e
            .server
            .requests()
            .into_iter()
            .filter(|r| r.path.ends_with("/leases/edge-1"))
            .collect();
        let i = log
            .iter()
            .position(|r| r.status == 409)
            .unwrap_or(log.len());
        log.iter()
            .skip(i + 1)
            .map(|r| (r.method.clone(), r.status))
            .collect()
    };
    wait_until(10, "reread and renewed after the conflict", || {
        after_conflict().len() >= 2
    })
    .await;
    let next = after_conflict();
    assert_eq!(
        (next[0].0.as_str(), next[0].1),
        ("GET", 200),
        "reread after 409"
    );
    assert_eq!(
        (next[1].0.as_str(), next[1].1),
        ("PUT", 200),
        "then renewed"
    );
    // The server logs the PUT before edgehub has read the answer and counted it: wait for it
    // (under qemu the gap is long enough to see).
    wait_until(10, "the renewal is counted", || {
        stats.lease_renewals.load(Ordering::Relaxed) > renewals
    })
    .await;
    assert_eq!(
        e.server.get("leases", "kube-node-lease", "edge-1").unwrap()["spec"]["holderIdentity"],
        "edge-1"
    );
}

#[tokio::test]
async fn memory_pressure_is_reported_at_once() {
    let e = env(FAST).await;
    let probe = device();
    let a = agent(&e, probe.clone());
    let stats = a.stats.clone();
    let (_l, link) = tokio::sync::watch::channel(LinkState::Online);
    let _stop = spawn(a, link);
    wait_until(10, "first status", || {
        stats.status_patches.load(Ordering::Relaxed) >= 1
    })
    .await;
    let node = e.server.get("nodes", "", "edge-1").unwrap();
    assert_eq!(condition(&node, "MemoryPressure")["status"], "False");
    probe.0.lock().unwrap().memory_available_bytes = 20 << 20;
    wait_until(10, "MemoryPressure=True on the Node", || {
        condition(
            &e.server.get("nodes", "", "edge-1").unwrap(),
            "MemoryPressure",
        )["status"]
            == "True"
    })
    .await;
    let node = e.server.get("nodes", "", "edge-1").unwrap();
    assert_eq!(
        condition(&node, "MemoryPressure")["reason"],
        "NodeHasInsufficientMemory"
    );
    assert_eq!(condition(&node, "Ready")["status"], "True");
    probe.0.lock().unwrap().disk_free_percent = Some(2);
    wait_until(10, "DiskPressure=True", || {
        condition(
            &e.server.get("nodes", "", "edge-1").unwrap(),
            "DiskPressure",
        )["status"]
            == "True"
    })
    .await;
}

#[tokio::test]
async fn when_the_link_returns_the_lease_goes_first_then_status() {
    // A slow timer, so only the link's return can explain prompt requests.
    let e = env("[node]\nlease_renew_secs = 30\n").await;
    let a = agent(&e, device());
    let stats = a.stats.clone();
    let (link_tx, link) = tokio::sync::watch::channel(LinkState::Online);
    let _stop = spawn(a, link);
    wait_until(10, "registered and reported", || {
        stats.status_patches.load(Ordering::Relaxed) >= 1
    })
    .await;

    e.server.set_offline(true).await.unwrap();
    link_tx
        .send(LinkState::Offline {
            reason: "test".into(),
        })
        .unwrap();
    // Let the agent see the outage before the link returns.
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Meanwhile the node lifecycle controller gave up on the node.
    e.server.modify("nodes", "", "edge-1", |n| {
        for c in n["status"]["conditions"].as_array_mut().unwrap() {
            if c["type"] == "Ready" {
                c["status"] = "Unknown".into();
                c["reason"] = "NodeStatusUnknown".into();
            }
        }
    });
    e.server.set_offline(false).await.unwrap();
    e.server.clear_log();
    let renewals = stats.lease_renewals.load(Ordering::Relaxed);
    link_tx.send(LinkState::Online).unwrap();
    wait_until(5, "lease renewed right after the link returned", || {
        stats.lease_renewals.load(Ordering::Relaxed) > renewals
    })
    .await;
    wait_until(5, "Ready=True again", || {
        condition(&e.server.get("nodes", "", "edge-1").unwrap(), "Ready")["status"] == "True"
    })
    .await;
    let writes: Vec<_> = e
        .server
        .requests()
        .into_iter()
        .filter(|r| r.method != "GET")
        .collect();
    assert!(
        writes[0].path.contains("/leases/"),
        "the Lease is written first: {:?}",
        writes[0]
    );
    assert!(
        writes[1].path.ends_with("/nodes/edge-1/status"),
        "then status: {:?}",
        writes[1]
    );
}

#[tokio::test]
async fn an_unreachable_apiserver_is_retried_without_crashing() {
    let e = env(FAST).await;
    e.server.set_offline(true).await.unwrap();
    let a = agent(&e, device());
    let stats = a.stats.clone();
    let (_l, link) = tokio::sync::watch::channel(LinkState::Offline { reason: "x".into() });
    let _stop = spawn(a, link);
    wait_until(10, "failed attempts are counted", || {
        stats.errors.load(Ordering::Relaxed) >= 2
    })
    .await;
    e.server.set_offline(false).await.unwrap();
    wait_until(10, "registered once the apiserver is back", || {
        e.server.get("nodes", "", "edge-1").is_some()
    })
    .await;
}
