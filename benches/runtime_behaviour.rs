//! The pod runtime's behaviour against the real containerd of scripts/cri-stack.sh and the
//! fake apiserver (needs root):
//! - pod start, from arriving in the cache to Ready, with its ConfigMap and token not yet
//!   cached and the Node authorizer lagging, beside containerd's own sandbox+create+start of
//!   the same pod's two containers in the same run;
//! - apiserver requests per pod per idle minute (pods with probes, a ConfigMap and a token);
//! - restart latency of a killed container, with another pod's image pull hanging and
//!   without.
//!
//! Prints numbers and `METRIC` lines for `benches/run.sh`; asserts nothing about time.
//! Run: `cargo bench --bench runtime_behaviour`.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;

use edgehub::cri::{api, labels, CriClient, CriRuntime};
use edgehub::object::Kind;
use edgehub::runtime::{BackoffPolicy, Reconciler};
use edgehub::store::{Change, OpenMode, Store, StoredObject};
use edgehub_testsupport::FakeApiServer;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const IMAGE: &str = "127.0.0.1:5000/busybox:1.0";

struct Node {
    server: FakeApiServer,
    store: Arc<Store>,
    client: edgehub::kube::ApiClient,
    name: String,
    dir: tempfile::TempDir,
    stop: Vec<tokio::sync::watch::Sender<bool>>,
}

async fn node(tag: &str) -> Node {
    let server = FakeApiServer::start().await.expect("fake apiserver");
    let dir = tempfile::tempdir().expect("tempdir");
    let kc = server
        .write_kubeconfig(&dir.path().join("kube"), edgehub_testsupport::NODE_TOKEN)
        .expect("kubeconfig");
    let data = dir.path().join("data");
    let store = Arc::new(Store::open(&data.join("edgehub.db"), OpenMode::Normal).expect("store"));
    let name = format!("bench-{tag}-{}", std::process::id());
    store
        .set_cursor(&edgehub::sync::pods_cursor_key(&name), "1")
        .expect("cursor");
    // The shipped timeouts (the tests' are short): a watch idles up to 120 s, and the fake
    // apiserver sends a bookmark every 60 s, as a real one does.
    let config = edgehub::config::Config::resolve(
        Some(""),
        Path::new("bench.toml"),
        &[],
        &edgehub::config::Overrides {
            node_name: Some("edge-1".into()),
            data_dir: Some(data.clone()),
            kubeconfig: Some(kc),
            ..Default::default()
        },
        None,
    )
    .expect("config");
    let client = common::client(&config);
    Node {
        server,
        store,
        client,
        name,
        dir,
        stop: Vec::new(),
    }
}

impl Node {
    /// The runtime loop, the sources fetcher and the report sender, as `edgehub run` has them.
    fn start(&mut self, socket: &Path, backoff: BackoffPolicy, pull: Duration) {
        let data = self.dir.path().join("data");
        let mut r = Reconciler::new(
            CriClient::new(socket).with_pull_deadline(pull),
            self.store.clone(),
            Some(self.client.clone()),
            data,
            self.name.clone(),
        );
        r.backoff = backoff;
        r.host_ip = Some("127.0.0.1".into());
        let (tx, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(r.run(Duration::from_secs(10), rx.clone()));
        tokio::spawn(
            edgehub::sources::fetch::Fetcher::new(self.client.clone(), self.store.clone())
                .run(rx.clone()),
        );
        tokio::spawn(
            edgehub::outbox::Sender::new(self.client.clone(), self.store.clone()).run(None, rx),
        );
        self.stop.push(tx);
    }

    fn put(&self, p: &Value) {
        let obj = StoredObject::from_raw(Kind::Pod, p.to_string()).expect("pod");
        self.store
            .apply(Kind::Pod, &[Change::Upsert(obj)], None)
            .expect("apply");
    }

    fn ready(&self, ns: &str, name: &str) -> bool {
        self.server.get("pods", ns, name).is_some_and(|p| {
            p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        })
    }

    async fn clean(self, socket: &Path) {
        drop(self.stop);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let c = CriClient::new(socket);
        for sb in c
            .list_pod_sandbox(HashMap::from([(
                labels::NODE.to_string(),
                self.name.clone(),
            )]))
            .await
            .unwrap_or_default()
        {
            let _ = c.stop_pod_sandbox(&sb.id).await;
            let _ = c.remove_pod_sandbox(&sb.id).await;
        }
    }
}

/// A pod bound to `edge-1`, the identity the fake apiserver's node token carries (the
/// runtime's own node name, which labels its CRI objects, is separate).
fn simple_pod(name: &str, uid: &str, image: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "bench", "uid": uid, "resourceVersion": "1",
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "ds", "controller": true}]},
        "spec": {"nodeName": "edge-1", "hostNetwork": true, "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "app", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", "touch /tmp/ready; while true; do sleep 1; done"]}]},
        "status": {"phase": "Pending"},
    })
}

async fn running(c: &CriClient, uid: &str) -> Vec<api::Container> {
    c.list_containers(HashMap::from([(
        labels::POD_UID.to_string(),
        uid.to_string(),
    )]))
    .await
    .unwrap_or_default()
    .into_iter()
    .filter(|x| x.state == api::ContainerState::ContainerRunning as i32)
    .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The recorded telemetry pod (two containers, a ConfigMap volume, the projected token),
/// bound now with the authorizer lagging `lag`: arrival in the cache -> Ready on the apiserver.
async fn start_with_sources(socket: &Path, lag: Duration, round: usize) -> f64 {
    let mut n = node(&format!("start{round}")).await;
    n.server.seed_recorded_cluster();
    n.server.remove("pods", "vehicle", "gateway-v9hb2");
    n.server.set_authorizer_lag(lag);
    let uid = format!("bench-start-{round}-{}", std::process::id());
    n.server.modify("pods", "vehicle", "telemetry-sv74m", |p| {
        p["metadata"]["uid"] = json!(uid);
    });
    n.start(socket, BackoffPolicy::default(), Duration::from_secs(300));
    let t = Instant::now();
    n.put(
        &n.server
            .get("pods", "vehicle", "telemetry-sv74m")
            .expect("pod"),
    );
    while !n.ready("vehicle", "telemetry-sv74m") {
        if t.elapsed() > Duration::from_secs(60) {
            println!("  start round {round}: not Ready after 60 s");
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let took = t.elapsed().as_secs_f64() * 1000.0;
    n.clean(socket).await;
    took
}

/// containerd alone: one sandbox, two containers created and started.
async fn containerd_two_containers(socket: &Path, round: usize) -> f64 {
    let c = CriClient::new(socket);
    let logs = tempfile::tempdir().expect("tempdir");
    let uid = format!("raw-start-{round}-{}", std::process::id());
    let t = Instant::now();
    let sb_cfg = common::host_network_sandbox(
        &format!("raw-start-{round}"),
        &uid,
        "bench",
        logs.path(),
        HashMap::from([("bench".to_string(), "raw".to_string())]),
    );
    let sb = c.run_pod_sandbox(sb_cfg.clone()).await.expect("sandbox");
    let mut ids = Vec::new();
    for name in ["app", "sidecar"] {
        let cfg = api::ContainerConfig {
            metadata: Some(api::ContainerMetadata {
                name: name.into(),
                attempt: 0,
            }),
            image: Some(api::ImageSpec {
                image: IMAGE.into(),
                ..Default::default()
            }),
            log_path: format!("{name}.log"),
            ..Default::default()
        };
        let id = c
            .create_container(&sb, cfg, sb_cfg.clone())
            .await
            .expect("create");
        c.start_container(&id).await.expect("start");
        ids.push(id);
    }
    let took = t.elapsed().as_secs_f64() * 1000.0;
    for id in ids {
        let _ = c.stop_container(&id, 0).await;
        let _ = c.remove_container(&id).await;
    }
    let _ = c.stop_pod_sandbox(&sb).await;
    let _ = c.remove_pod_sandbox(&sb).await;
    took
}

/// `pods` pods with a readiness probe, a ConfigMap and the token volume, Ready and settled:
/// requests at the apiserver over one idle minute.
async fn idle_minute(socket: &Path, pods: usize) -> BTreeCount {
    let mut n = node("idle").await;
    for i in 0..pods {
        let name = format!("idle-{i}");
        let mut p = simple_pod(
            &name,
            &format!("bench-idle-{i}-{}", std::process::id()),
            IMAGE,
        );
        p["spec"]["automountServiceAccountToken"] = json!(true);
        p["spec"]["volumes"] = json!([
            {"name": "cfg", "configMap": {"name": format!("cfg-{i}")}},
            {"name": "kube-api-access", "projected": {"sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}]}}]);
        p["spec"]["containers"][0]["readinessProbe"] =
            json!({"exec": {"command": ["cat", "/tmp/ready"]}, "periodSeconds": 1});
        n.server.apply(
            "configmaps",
            json!({"metadata": {"name": format!("cfg-{i}"), "namespace": "bench"}, "data": {"k": "v"}}),
        );
        n.server.apply("pods", p);
        n.put(&n.server.get("pods", "bench", &name).expect("pod"));
    }
    n.start(socket, BackoffPolicy::default(), Duration::from_secs(300));
    let t = Instant::now();
    while !(0..pods).all(|i| n.ready("bench", &format!("idle-{i}"))) {
        if t.elapsed() > Duration::from_secs(60) {
            println!("  idle: pods not Ready after 60 s");
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The cache follows the apiserver, as the pod watch would deliver it.
    for i in 0..pods {
        n.put(
            &n.server
                .get("pods", "bench", &format!("idle-{i}"))
                .expect("pod"),
        );
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    n.server.clear_log();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let counts = n.server.count_by_verb();
    n.clean(socket).await;
    BTreeCount(counts)
}

struct BTreeCount(std::collections::BTreeMap<(String, String), usize>);

/// Kill -> the next attempt running, with a pull of another pod hanging or not.
async fn restart_latency(socket: &Path, hanging: bool, round: usize) -> f64 {
    let mut n = node(&format!("restart{round}{hanging}")).await;
    let c = CriClient::new(socket);
    let live_uid = format!("bench-live-{round}-{hanging}-{}", std::process::id());
    n.put(&simple_pod("live", &live_uid, IMAGE));
    let _hole = if hanging {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = l.local_addr().expect("addr").port();
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                held.push(s);
            }
        });
        let mut p = simple_pod(
            "hang",
            &format!("bench-hang-{round}-{}", std::process::id()),
            &format!("127.0.0.1:{port}/hang:1.0"),
        );
        p["spec"]["containers"][0]["imagePullPolicy"] = json!("Always");
        n.put(&p);
        Some(task)
    } else {
        None
    };
    let backoff = BackoffPolicy {
        initial: Duration::from_millis(100),
        max: Duration::from_millis(100),
    };
    n.start(socket, backoff, Duration::from_secs(120));
    while running(&c, &live_uid).await.is_empty() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let first = running(&c, &live_uid).await[0].id.clone();
    let runc_root = socket
        .parent()
        .map(|p| p.join("runc/k8s.io"))
        .unwrap_or_default();
    let t = Instant::now();
    let _ = std::process::Command::new("runc")
        .arg("--root")
        .arg(&runc_root)
        .args(["kill", &first, "KILL"])
        .status();
    while !running(&c, &live_uid).await.iter().any(|x| x.id != first) {
        if t.elapsed() > Duration::from_secs(60) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let took = t.elapsed().as_secs_f64() * 1000.0;
    n.clean(socket).await;
    took
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("runtime behaviour benchmark: run with `cargo bench --bench runtime_behaviour` (root, containerd test stack)");
        return;
    }
    let socket = common::cri_stack();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let _ = containerd_two_containers(&socket, 99).await; // warm-up
        let lag = Duration::from_millis(500);
        let (mut eh, mut raw) = (Vec::new(), Vec::new());
        for round in 0..5 {
            eh.push(start_with_sources(&socket, lag, round).await);
            raw.push(containerd_two_containers(&socket, round).await);
        }
        let (eh, raw) = (median(eh), median(raw));
        println!(
            "pod start, arrival in cache -> Ready on the apiserver (ConfigMap + token not cached, authorizer lag {} ms): median {eh:.0} ms over 5; containerd's own sandbox + 2 x (create + start): {raw:.0} ms; edgehub adds {:.0} ms (budget 1000 ms)",
            lag.as_millis(),
            eh - raw
        );
        support::metric("pod_ready_with_sources_ms", eh, "ms");
        support::metric("pod_ready_overhead_ms", eh - raw, "ms");

        let pods = 5;
        let counts = idle_minute(&socket, pods).await;
        let total: usize = counts.0.values().sum();
        println!(
            "idle minute, {pods} pods with readiness probes, a ConfigMap and a token each: {total} requests ({:.2} per pod per minute; budget 0 beyond the node's Lease, which this bench does not run): {:?}",
            total as f64 / pods as f64,
            counts.0
        );
        support::metric(
            "apiserver_requests_per_pod_per_idle_minute",
            total as f64 / pods as f64,
            "",
        );

        let (mut quiet, mut busy) = (Vec::new(), Vec::new());
        for round in 0..3 {
            quiet.push(restart_latency(&socket, false, round).await);
            busy.push(restart_latency(&socket, true, round).await);
        }
        println!(
            "restart of a killed container (backoff 100 ms): median {:.0} ms alone, {:.0} ms while another pod's pull hangs (3 rounds each)",
            median(quiet.clone()),
            median(busy.clone())
        );
        support::metric("restart_ms_alone", median(quiet), "ms");
        support::metric("restart_ms_beside_hanging_pull", median(busy), "ms");
    });
}
