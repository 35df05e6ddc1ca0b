//! `GET /pods` is kept rendered (`api::rendered`) and served as it is until the store changes.
//! Each pod's `PodNeedUpgrade` depends on more than the pod: its DaemonSet, the DaemonSet's
//! revisions, the revision an upgrade committed on the device, the status queued for the
//! apiserver. Each of those changes here, through the real HTTP server, and the very next
//! GET must show it.

mod common;

use common::Harness;
use edgehub::api::{self, listen, ApiState, Listener};
use edgehub::store::{Effects, NewRequest, QueuedStatus, Recorded, RequestKind, RunningRevision};
use edgehub_testsupport::fixture_body;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

async fn start_api(h: &Harness) -> (SocketAddr, Arc<ApiState>, tokio::sync::watch::Sender<bool>) {
    let mut cfg = h.config.clone();
    cfg.api_addr = Some("127.0.0.1:0".parse().unwrap());
    let Listener::Tcp(tcp) = listen::bind(cfg.api_addr, &cfg.api)
        .await
        .unwrap()
        .remove(0)
    else {
        panic!("tcp first")
    };
    let addr = tcp.local_addr().unwrap();
    let state = Arc::new(ApiState {
        store: h.store.clone().unwrap(),
        link: h.sync().link.clone(),
        sync_stats: h.sync().stats.clone(),
        metrics: Default::default(),
        token: None,
        socket: Default::default(),
        node_name: "edge-1".into(),
        cri: tokio::sync::watch::channel(edgehub::cri::CriHealth::Ready {
            version: "containerd://1.6.20".into(),
        })
        .1,
        runtime: None,
        streams: Default::default(),
        images: None,
        image_gc: None,
        identity: None,
        pods: Default::default(),
        commit_deadline: std::time::Duration::from_secs(1800),
    });
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(api::serve(Listener::Tcp(tcp), state.clone(), rx));
    (addr, state, tx)
}

/// `GET /pods` over HTTP/1.1: the raw body.
async fn get_pods(addr: SocketAddr) -> String {
    let c = edgehub::local_client::LocalClient {
        target: edgehub::local_client::Target::Tcp(addr),
        token: None,
        timeout: Duration::from_secs(10),
    };
    let a = tokio::task::spawn_blocking(move || c.get("/pods"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(a.status, 200, "{}", a.body);
    a.body
}

fn pod<'a>(list: &'a Value, name: &str) -> &'a Value {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["metadata"]["name"] == name)
        .unwrap_or(&Value::Null)
}

fn need(list: &Value, name: &str) -> (String, String) {
    let c = pod(list, name)["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "PodNeedUpgrade")
        .cloned()
        .unwrap();
    (
        c["status"].as_str().unwrap().into(),
        c["reason"].as_str().unwrap_or("").into(),
    )
}

async fn list(addr: SocketAddr) -> Value {
    serde_json::from_str(&get_pods(addr).await).unwrap()
}

#[tokio::test]
async fn every_change_the_pod_list_depends_on_shows_in_the_next_get() {
    let mut h = Harness::new().await;
    h.start();
    h.wait_converged().await;
    let (addr, state, _stop) = start_api(&h).await;
    let store = h.store.clone().unwrap();

    let first = get_pods(addr).await;
    assert!(state.pods.is_kept(), "the list is kept once rendered");
    assert_eq!(get_pods(addr).await, first, "served as kept");
    let l: Value = serde_json::from_str(&first).unwrap();
    assert_eq!(need(&l, "telemetry-sv74m").0, "False");

    // The DaemonSet and its revisions: the operator rolls telemetry.
    for item in fixture_body("controllerrevisions_list_rev2")["items"]
        .as_array()
        .unwrap()
    {
        h.server.apply("controllerrevisions", item.clone());
    }
    h.server
        .apply("daemonsets", fixture_body("daemonset_after_update"));
    h.wait_converged().await;
    let l = list(addr).await;
    assert_eq!(
        need(&l, "telemetry-sv74m"),
        ("True".into(), "NewRevisionAvailable".into()),
        "a new revision shows in the next GET"
    );

    // A pod.
    h.server.modify("pods", "vehicle", "gateway-v9hb2", |p| {
        p["metadata"]["annotations"]["test/seen"] = json!("yes");
    });
    h.wait_converged().await;
    let l = list(addr).await;
    assert_eq!(
        pod(&l, "gateway-v9hb2")["metadata"]["annotations"]["test/seen"],
        "yes"
    );

    // An upgrade's effect: the device now runs the new revision, before the cloud knows.
    let tele = store
        .get(edgehub::object::Kind::Pod, "vehicle", "telemetry-sv74m")
        .unwrap()
        .unwrap();
    let req = NewRequest {
        kind: RequestKind::Upgrade,
        pod_uid: &tele.index.uid,
        namespace: "vehicle",
        name: "telemetry-sv74m",
        from_hash: tele.index.revision_hash.as_deref(),
        to_hash: "55778fbb9f",
    };
    let Recorded::New(r) = store.record_request(&req).unwrap() else {
        panic!("a new request")
    };
    let running = RunningRevision {
        pod_uid: tele.index.uid.clone(),
        hash: "55778fbb9f".into(),
        images: "{}".into(),
        committed_ms: 1,
        namespace: Some("vehicle".into()),
        owner_uid: tele.index.owner_uid.clone(),
        awaiting_since_ms: None,
    };
    let effects = Effects {
        running: Some(running),
        ..Default::default()
    };
    assert!(store
        .transition(r.id, "Requested", "Done", None, None, &effects)
        .unwrap());
    let l = list(addr).await;
    assert_eq!(
        need(&l, "telemetry-sv74m").0,
        "False",
        "the committed revision counts at once"
    );
    assert_eq!(
        pod(&l, "telemetry-sv74m")["metadata"]["labels"]["controller-revision-hash"],
        "55778fbb9f"
    );

    // A status queued for the apiserver is served before the cloud has it.
    store
        .queue_status(&QueuedStatus {
            pod_uid: tele.index.uid.clone(),
            namespace: "vehicle".into(),
            name: "telemetry-sv74m".into(),
            status: json!({"phase": "Running", "podIP": "10.9.8.7"}).to_string(),
        })
        .unwrap();
    let l = list(addr).await;
    assert_eq!(pod(&l, "telemetry-sv74m")["status"]["podIP"], "10.9.8.7");

    // A pod deleted.
    h.server.remove("pods", "vehicle", "gateway-v9hb2");
    h.wait_converged().await;
    let l = list(addr).await;
    assert!(pod(&l, "gateway-v9hb2").is_null());
    h.stop().await;
}
