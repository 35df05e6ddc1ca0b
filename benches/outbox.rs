//! The outbox, measured against the fake apiserver (real TLS, real HTTP), as the node
//! identity `edge-1`:
//! - drain rate: N pods (N = 100 and 1000), each cached, bound to the node and on the server,
//!   each with a queued status (Pending -> Running and Ready) and one queued Event; reports (a
//!   status or an Event) delivered per second by `outbox::Sender::drain` until the outbox is
//!   empty, with `max_rate` unlimited (0), and for N = 100 with the shipped default of
//!   `[report] max_rate`; medians over 3 runs, each on a fresh server and store;
//! - apiserver requests per device when the link returns with 100 pods owing a status and an
//!   Event each: every request the apiserver sees while the outbox drains, in total, by verb
//!   and per report (the reflectors' relist and watches on reconnect are not counted here).
//!
//! Prints human-readable lines and `METRIC <key> <value>` lines; asserts nothing about time.
//! Run: `cargo bench --bench outbox`.

use edgehub::config::{Config, Overrides};
use edgehub::kube::ApiClient;
use edgehub::object::Kind;
use edgehub::outbox::Sender;
use edgehub::store::{Change, OpenMode, QueuedEvent, QueuedStatus, Store, StoredObject};
use edgehub_testsupport::{fixture_body, FakeApiServer, NODE_TOKEN};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The node the fake apiserver's node token speaks for.
const NODE: &str = "edge-1";
const RUNS: usize = 3;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The configuration edgehub ships with, pointed at `kubeconfig`.
fn config(data: &Path, kubeconfig: &Path) -> Config {
    let flags = Overrides {
        node_name: Some(NODE.into()),
        data_dir: Some(data.to_path_buf()),
        kubeconfig: Some(kubeconfig.to_path_buf()),
        ..Default::default()
    };
    Config::resolve(None, Path::new("bench.toml"), &[], &flags, None).expect("config")
}

/// The recorded telemetry pod (Pending, two containers, bound to `edge-1`), renamed.
fn pod_named(template: &Value, i: usize) -> Value {
    let mut p = template.clone();
    p["metadata"]["name"] = json!(format!("bench-{i:05}"));
    p["metadata"]["uid"] = json!(format!("00000000-0000-4000-8000-{i:012}"));
    p["spec"]["nodeName"] = json!(NODE);
    p
}

/// The status the runtime would want for a started pod: Running, Ready, both containers up.
fn running_status(pod: &Value, i: usize) -> Value {
    let now = edgehub::time::now();
    let cond = |t: &str| json!({"type": t, "status": "True", "lastProbeTime": null, "lastTransitionTime": now});
    let containers: Vec<Value> = pod["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(n, c)| {
            json!({
                "name": c["name"], "image": c["image"], "imageID": "",
                "containerID": format!("containerd://{i:08x}{n:056x}"),
                "ready": true, "started": true, "restartCount": 0,
                "state": {"running": {"startedAt": now}}, "lastState": {},
            })
        })
        .collect();
    json!({
        "phase": "Running",
        "conditions": [cond("PodReadyToStartContainers"), cond("Initialized"), cond("Ready"),
            cond("ContainersReady"), cond("PodScheduled")],
        "hostIP": "10.0.0.2", "hostIPs": [{"ip": "10.0.0.2"}],
        "podIP": "10.0.0.2", "podIPs": [{"ip": "10.0.0.2"}],
        "startTime": now,
        "containerStatuses": containers,
        "qosClass": "Burstable",
    })
}

/// A fake apiserver with `n` pods bound to the node, the same pods cached, and each pod
/// owing a status and one Event.
struct Device {
    server: FakeApiServer,
    store: Arc<Store>,
    client: ApiClient,
    config: Config,
    _dir: tempfile::TempDir,
}

async fn device(template: &Value, n: usize) -> Device {
    let server = FakeApiServer::start().await.expect("fake apiserver");
    let dir = tempfile::tempdir().expect("tempdir");
    let kc = server
        .write_kubeconfig(&dir.path().join("kube"), NODE_TOKEN)
        .expect("kubeconfig");
    let data = dir.path().join("data");
    let config = config(&data, &kc);
    let client = config.api_client().expect("client");
    let store = Arc::new(Store::open(&data.join("edgehub.db"), OpenMode::Normal).expect("store"));
    let mut cached = Vec::with_capacity(n);
    for i in 0..n {
        let p = pod_named(template, i);
        let stored = server.apply("pods", p.clone());
        let obj = StoredObject::from_raw(Kind::Pod, stored.to_string()).expect("pod");
        let event = edgehub::pod::status::pod_event(
            &obj,
            "Normal",
            "Started",
            "Started the pod's containers",
            NODE,
            &edgehub::time::now(),
        );
        store
            .queue_status(&QueuedStatus {
                pod_uid: obj.index.uid.clone(),
                namespace: obj.index.namespace.clone(),
                name: obj.index.name.clone(),
                status: running_status(&p, i).to_string(),
            })
            .expect("queue status");
        store
            .queue_event(
                &QueuedEvent {
                    pod_uid: obj.index.uid.clone(),
                    key: format!(
                        "{}/{}",
                        obj.index.namespace,
                        event["metadata"]["name"].as_str().unwrap_or_default()
                    ),
                    namespace: obj.index.namespace.clone(),
                    body: event.to_string(),
                    occurrences: 1,
                },
                edgehub::time::now_ms(),
            )
            .expect("queue event");
        cached.push(Change::Upsert(obj));
    }
    store.apply(Kind::Pod, &cached, None).expect("cache pods");
    Device {
        server,
        store,
        client,
        config,
        _dir: dir,
    }
}

/// What draining the whole outbox took.
struct Run {
    reports: usize,
    requests: usize,
    dropped: usize,
    parked: usize,
    left: u64,
    secs: f64,
}

/// Drains until the outbox is empty (or nothing more is due for a while).
async fn drain_all(d: &Device, max_rate: u32) -> Run {
    let mut sender = Sender::new(d.client.clone(), d.store.clone());
    sender.max_rate = max_rate;
    let mut run = Run {
        reports: 0,
        requests: 0,
        dropped: 0,
        parked: 0,
        left: 0,
        secs: 0.0,
    };
    let t = Instant::now();
    let mut idle = 0;
    loop {
        let done = sender.drain().await.expect("drain");
        run.reports += done.statuses_sent + done.events_sent;
        run.requests += done.requests;
        run.dropped += done.dropped;
        run.parked += done.parked;
        let (queued, _) = d.store.outbox_counts().expect("counts");
        run.left = queued;
        if queued == 0 || done.offline {
            break;
        }
        // Rows waiting for a retry: give them a little while, then report what is left.
        idle += 1;
        if idle > 50 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    run.secs = t.elapsed().as_secs_f64();
    run
}

fn warn_if_incomplete(run: &Run, what: &str) {
    if run.left > 0 || run.dropped > 0 || run.parked > 0 {
        println!(
            "  {what}: {} still queued, {} dropped, {} parked",
            run.left, run.dropped, run.parked
        );
    }
}

/// Median reports per second over [`RUNS`] runs, each on a fresh device.
async fn drain_rate(template: &Value, n: usize, max_rate: u32) -> f64 {
    let mut rates = Vec::with_capacity(RUNS);
    let mut requests = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let d = device(template, n).await;
        let run = drain_all(&d, max_rate).await;
        warn_if_incomplete(&run, &format!("{n} pods, max_rate {max_rate}"));
        rates.push(run.reports as f64 / run.secs);
        requests.push(run.requests);
    }
    let limit = if max_rate == 0 {
        "unlimited".to_string()
    } else {
        format!("{max_rate}/s")
    };
    let m = median(rates.clone());
    println!(
        "outbox drain, {n} pods ({} reports), max_rate {limit}: median {m:.0} reports/s over {RUNS} runs (all: {rates:.0?}; requests per run: {requests:?})",
        2 * n
    );
    m
}

/// Requests the apiserver sees while a device with `n` pods, each owing a status and an
/// Event, drains its outbox after the link returns.
async fn reconnect_requests(template: &Value, n: usize) -> usize {
    let d = device(template, n).await;
    let max_rate = d.config.report.max_rate;
    d.server.clear_log();
    let run = drain_all(&d, max_rate).await;
    warn_if_incomplete(&run, "reconnect");
    let total = d.server.requests().len();
    let reports = 2 * n;
    println!(
        "reconnect with {n} pods owing a status and an Event each ({reports} reports, max_rate {max_rate}/s): {total} apiserver requests per device in {:.1} s, {:.2} per report",
        run.secs,
        total as f64 / reports as f64
    );
    for ((verb, resource), count) in d.server.count_by_verb() {
        println!("  {verb} {resource}: {count}");
    }
    total
}

fn main() {
    // `cargo test --benches` runs bench targets with --bench absent; only run when benchmarking.
    if !std::env::args().any(|a| a == "--bench") {
        println!("outbox benchmark: run with `cargo bench --bench outbox`");
        return;
    }
    let template = fixture_body("pods_list_node")["items"][1].clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let shipped = {
            let dir = tempfile::tempdir().expect("tempdir");
            config(dir.path(), &dir.path().join("kubeconfig"))
                .report
                .max_rate
        };
        let r100 = drain_rate(&template, 100, 0).await;
        let r1000 = drain_rate(&template, 1000, 0).await;
        // Paced, the rate is the limit's whatever the queue's length: 100 pods are enough
        // (1000 would take minutes a run).
        drain_rate(&template, 100, shipped).await;
        let requests = reconnect_requests(&template, 100).await;
        println!("METRIC outbox_drain_reports_per_s_100 {r100:.1}");
        println!("METRIC outbox_drain_reports_per_s_1000 {r1000:.1}");
        println!("METRIC outbox_reconnect_requests_per_device_100_reports {requests}");
    });
}
