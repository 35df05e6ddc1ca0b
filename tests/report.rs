//! The report back to the cloud, end to end: the edgehub binary, real containerd, the fake
//! apiserver, and between them, where a test needs it, a TCP fault proxy. Needs root; without
//! it these tests fail, loudly.
//!
//! The outbox's rules one by one (order per pod, retry, drop, park, the Event series, a
//! restart with a full outbox) are unit tests in src/outbox/tests.rs; here they meet a link
//! that misbehaves.

mod common;
#[path = "common/edge.rs"]
mod edge;

use edge::node;
use edgehub::cri::CriRuntime;
use edgehub_testsupport::chaos::{ChaosProxy, Fault};
use edgehub_testsupport::daemonset_sim::pod_for;
use serde_json::Value;
use std::time::{Duration, Instant};

/// The outbox as `GET /v1/status` shows it.
fn outbox(n: &edge::Node) -> Option<Value> {
    let (code, body) = n.http("GET", "/v1/status");
    (code == 200)
        .then(|| serde_json::from_str::<Value>(&body).ok())
        .flatten()
        .map(|v| v["outbox"].clone())
}

fn event(n: &edge::Node, pod: &str, reason: &str) -> Option<Value> {
    n.server
        .get("events", "vehicle", &format!("{pod}.edgehub-{reason}"))
}

/// The running containers named `name` of this node, whichever pod uid labels them (the
/// adopted pod's restarts carry the replacement's).
async fn running_any(n: &edge::Node, name: &str) -> Vec<edgehub::cri::api::Container> {
    use edgehub::cri::{api, labels};
    n.cri
        .list_containers(std::collections::HashMap::from([(
            labels::NODE.to_string(),
            n.name.clone(),
        )]))
        .await
        .unwrap_or_default()
        .into_iter()
        .filter(|c| {
            c.state == api::ContainerState::ContainerRunning as i32
                && c.labels.get(labels::CONTAINER_NAME).map(String::as_str) == Some(name)
        })
        .collect()
}

/// The outbox's rows, for a failure's message.
fn outbox_rows(n: &edge::Node) -> Vec<String> {
    let Ok(conn) = rusqlite::Connection::open_with_flags(
        n.dir.path().join("data/edgehub.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    ) else {
        return Vec::new();
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let Ok(mut stmt) = conn.prepare(
        "SELECT id, kind, name, attempts, next_attempt_ms, last_error, parked FROM outbox",
    ) else {
        return Vec::new();
    };
    stmt.query_map([], |r| {
        Ok(format!(
            "{} {} {} attempts={} due_in_ms={} parked={} error={:?}",
            r.get::<_, i64>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, String>(2)?,
            r.get::<_, i64>(3)?,
            r.get::<_, i64>(4)? - now,
            r.get::<_, i64>(6)?,
            r.get::<_, Option<String>>(5)?,
        ))
    })
    .map(|rows| rows.filter_map(Result::ok).collect())
    .unwrap_or_default()
}

/// The pod as edgehub's cache holds it, read through a second connection.
fn cached_pod(n: &edge::Node, name: &str) -> Option<Value> {
    let conn = rusqlite::Connection::open_with_flags(
        n.dir.path().join("data/edgehub.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .ok()?;
    conn.query_row(
        "SELECT raw FROM objects WHERE kind = 'Pod' AND namespace = 'vehicle' AND name = ?1",
        [name],
        |r| r.get::<_, String>(0),
    )
    .ok()
    .and_then(|raw| serde_json::from_str(&raw).ok())
}

/// The DaemonSet controller's stand-in: once the old pod object is deleted, it creates the
/// replacement at the update revision, as fixtures/pods_list_after_delete.json shows.
fn replace_when_deleted(n: &edge::Node) {
    if n.server.get("pods", "vehicle", "telemetry-sv74m").is_none()
        && n.server.get("pods", "vehicle", "telemetry-x7k2p").is_none()
    {
        let ds = n.server.get("daemonsets", "vehicle", "telemetry").unwrap();
        let cr = n
            .server
            .get("controllerrevisions", "vehicle", "telemetry-55778fbb9f")
            .unwrap();
        n.server.apply("pods", pod_for(&ds, &cr, &n.name, "x7k2p"));
    }
}

/// Points the node's kubeconfig at `proxy` instead of the apiserver.
fn through(n: &edge::Node, proxy: &ChaosProxy) {
    let kc = n.dir.path().join("kube/kubeconfig");
    let text = std::fs::read_to_string(&kc).unwrap();
    assert!(text.contains(&n.server.url()), "{text}");
    std::fs::write(&kc, text.replace(&n.server.url(), &proxy.url())).unwrap();
}

/// Link chaos: between edgehub and the apiserver the link drops, stalls, resets, and the
/// apiserver answers 500 and 429, in many short cycles, while the pod is upgraded, its
/// sidecar crashes (status changes), and edgehub itself is killed and started again. When
/// the link settles: the DaemonSet controller's replacement adopts the upgraded pod, each
/// Event is there once (count 1), in the order it happened, the status in the cloud is the
/// one the device has, and the cache equals the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_link_chaos_every_report_arrives_once_in_order() {
    let mut n = node("chaos").await;
    let proxy = ChaosProxy::start(n.server.addr).await.unwrap();
    through(&n, &proxy);
    n.start();
    n.wait_for(60, "the pod runs", |n| async move {
        n.running("app").await.len() == 1 && n.running("sidecar").await.len() == 1
    })
    .await;
    n.server.roll_telemetry();
    n.wait_for(30, "PodNeedUpgrade True", |n| async move {
        n.need().is_some_and(|c| c["status"] == "True")
    })
    .await;

    let faults = [
        Fault::Drop,
        Fault::Pass,
        Fault::Stall,
        Fault::Reset,
        Fault::Pass,
        Fault::Stall,
        Fault::Drop,
        Fault::Reset,
    ];
    let mut sidecar_kills = 0;
    let mut last_kill = Instant::now();
    let mut upgraded = false;
    let mut restarted = false;
    let started = Instant::now();
    for cycle in 0..30 {
        proxy.set(faults[cycle % faults.len()]);
        match cycle % 4 {
            // The apiserver itself fails some writes.
            0 => n.server.fail_next(2, 500, None, &["/status"]),
            1 => n.server.fail_next(2, 429, Some(1), &["/events"]),
            _ => {}
        }
        if cycle == 2 {
            let (code, body) = n.http("POST", &n.upgrade_path());
            assert_eq!(code, 200, "{body}");
            upgraded = true;
        }
        if cycle >= 3 && last_kill.elapsed() > Duration::from_secs(5) {
            // The sidecar crashes: a new restartCount and lastState to report.
            if let Some(c) = running_any(&n, "sidecar").await.first() {
                n.cri.stop_container(&c.id, 0).await.unwrap();
                sidecar_kills += 1;
                last_kill = Instant::now();
            }
        }
        if cycle == 13 {
            // Killed with whatever is queued; started again.
            n.kill9();
            n.start();
            restarted = true;
        }
        replace_when_deleted(&n);
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    assert!(
        upgraded && restarted && sidecar_kills >= 1,
        "{sidecar_kills} kills\n{}",
        n.log()
    );
    eprintln!("chaos for {} s", started.elapsed().as_secs());
    // The link settles, and so does the apiserver: failures queued for requests that never
    // came (16 500s on /status over the cycles) would otherwise go on failing the node's and
    // the pods' status patches one backoff after another.
    proxy.set(Fault::Pass);
    n.server.clear_failures();

    let end = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "Done", "{end}\n{}", n.log());
    n.wait_for(90, "edgehub deletes the old pod object", |n| async move {
        replace_when_deleted(n);
        n.server.get("pods", "vehicle", "telemetry-x7k2p").is_some()
    })
    .await;
    let app = running_any(&n, "app").await;
    assert_eq!(app.len(), 1);
    let app_id = app[0].id.clone();
    // What runs is settled once the last killed sidecar is back: no more kills come.
    n.wait_for(60, "the sidecar runs again", |n| async move {
        !running_any(n, "sidecar").await.is_empty()
    })
    .await;
    let sidecar_attempt = running_any(&n, "sidecar").await[0]
        .metadata
        .as_ref()
        .map(|m| m.attempt)
        .unwrap();
    // The event that proves the report: the apiserver commits the replacement's status
    // saying what runs.
    let reported = n
        .server
        .wait_for_object(
            "pods",
            "vehicle",
            "telemetry-x7k2p",
            Duration::from_secs(90),
            |p| {
                let cs = |name: &str| {
                    p["status"]["containerStatuses"]
                        .as_array()
                        .and_then(|a| a.iter().find(|c| c["name"] == name).cloned())
                        .unwrap_or(Value::Null)
                };
                cs("app")["containerID"] == format!("containerd://{app_id}").as_str()
                    && cs("app")["image"] == "127.0.0.1:5000/busybox:2.0"
                    && cs("sidecar")["restartCount"] == sidecar_attempt
                    && cs("sidecar")["ready"] == true
            },
        )
        .await;
    if let Err(p) = reported {
        panic!(
            "the replacement never reported what runs (sidecar attempt {sidecar_attempt}):\n\
             {p:#}\noutbox: {:?}\nrows: {:#?}\n{}",
            outbox(&n),
            outbox_rows(&n),
            n.log()
        );
    }
    // And the one that proves nothing more is on its way: the outbox is empty, so no Event
    // can be written again.
    n.wait_for(30, "nothing is left to send", |n| async move { drained(n) })
        .await;

    // Each Event once, in the order it happened.
    let started_ev = event(&n, "telemetry-sv74m", "upgradestarted").expect("UpgradeStarted");
    let succeeded = event(&n, "telemetry-sv74m", "upgradesucceeded").expect("UpgradeSucceeded");
    assert_eq!(started_ev["count"], 1, "{started_ev}");
    assert_eq!(succeeded["count"], 1, "{succeeded}");
    let rv = |e: &Value| {
        e["metadata"]["resourceVersion"]
            .as_str()
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap()
    };
    assert!(
        rv(&started_ev) < rv(&succeeded),
        "UpgradeStarted reached the cloud first"
    );

    // The cache equals the server.
    n.wait_for(30, "the cache holds the server's pod", |n| async move {
        let server = n.server.get("pods", "vehicle", "telemetry-x7k2p");
        let cached = cached_pod(n, "telemetry-x7k2p");
        server.is_some()
            && server.as_ref().map(|p| &p["metadata"]["resourceVersion"])
                == cached.as_ref().map(|p| &p["metadata"]["resourceVersion"])
            && cached_pod(n, "telemetry-sv74m").is_none()
    })
    .await;
    assert_eq!(
        running_any(&n, "app").await[0].id,
        app_id,
        "nothing restarted"
    );
    n.clean().await;
}

/// The pod is deleted in the cloud while the device is offline with reports queued for it:
/// when the link returns its status rows are dropped (404, nobody to report to), its
/// containers stopped, and nothing is left queued or parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_deleted_in_the_cloud_while_offline_is_stopped_and_its_rows_dropped() {
    let mut n = node("gone").await;
    n.rolled_and_offline().await;
    let (code, _) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200);
    let end = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "Done", "{end}");
    // Offline, a crash of the sidecar: one more status to report.
    let sidecar = n.running("sidecar").await[0].id.clone();
    n.cri.stop_container(&sidecar, 0).await.unwrap();
    n.wait_for(30, "reports are queued", |n| async move {
        outbox(n).is_some_and(|o| o["queued"].as_u64().unwrap_or(0) >= 2)
    })
    .await;

    // Meanwhile in the cloud: the operator deletes the pod (and the DaemonSet, so no
    // replacement comes).
    n.server.remove("daemonsets", "vehicle", "telemetry");
    n.server.remove("pods", "vehicle", "telemetry-sv74m");
    n.server.clear_log();
    n.server.set_offline(false).await.unwrap();

    n.wait_for(60, "its containers are stopped", |n| async move {
        n.sandboxes().await.is_empty() && n.running("app").await.is_empty()
    })
    .await;
    n.wait_for(30, "nothing queued or parked", |n| async move {
        outbox(n).is_some_and(|o| o["queued"] == 0 && o["parked"] == Value::Array(vec![]))
    })
    .await;
    let patched = n
        .server
        .count(|r| r.resource == "pods/status" && (200..300).contains(&r.status));
    assert_eq!(patched, 0, "no status reached a pod that is gone");
    assert!(
        n.server.get("pods", "vehicle", "telemetry-sv74m").is_none(),
        "the deleted pod stays deleted"
    );
    n.clean().await;
}

/// A status the apiserver refuses for good (400) is parked, shown in `/v1/status` and
/// `/metrics` with its error, and the Events queued behind it for the same pod still go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_status_does_not_hold_back_the_events_behind_it() {
    let mut n = node("parked").await;
    n.start();
    n.wait_for(60, "the pod runs", |n| async move {
        n.running("app").await.len() == 1 && n.running("sidecar").await.len() == 1
    })
    .await;
    n.server.roll_telemetry();
    n.wait_for(30, "PodNeedUpgrade True", |n| async move {
        n.need().is_some_and(|c| c["status"] == "True")
    })
    .await;
    // Every status patch of this pod is refused from now on.
    n.server
        .fail_next(1000, 400, None, &["telemetry-sv74m/status"]);
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let end = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "Done", "{end}");
    n.wait_for(30, "the status row is parked", |n| async move {
        outbox(n).is_some_and(|o| {
            o["parked"].as_array().is_some_and(|p| {
                p.iter()
                    .any(|r| r["kind"] == "status" && r["name"] == "telemetry-sv74m")
            })
        })
    })
    .await;
    n.wait_for(30, "the Events behind it arrive", |n| async move {
        event(n, "telemetry-sv74m", "upgradestarted").is_some()
            && event(n, "telemetry-sv74m", "upgradesucceeded").is_some()
    })
    .await;
    let o = outbox(&n).unwrap();
    let parked = o["parked"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["kind"] == "status")
        .unwrap()
        .clone();
    assert!(
        parked["error"].as_str().unwrap_or("").contains("400"),
        "the parked row says why: {parked}"
    );
    let (code, metrics) = n.http("GET", "/metrics");
    assert_eq!(code, 200);
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("edgehub_outbox_rows{state=\"parked\"}") && !l.ends_with(" 0")),
        "{metrics}"
    );
    let (code, text) = {
        let out = n.cmd(&["status"]).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
        )
    };
    assert_eq!(code, Some(0));
    assert!(text.contains("parked"), "{text}");
    n.clean().await;
}

/// `report.mode = "patch"`, for an identity allowed to patch pods (not a node's): when the
/// link returns, the pod object keeps its uid and gets the images and the revision label it
/// runs; nothing restarts and `PodNeedUpgrade` turns False.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patch_mode_patches_the_images_and_the_revision_label() {
    let mut n = node("patchmode").await;
    // [report] is the config's last table.
    let mut config = std::fs::read_to_string(&n.config).unwrap();
    assert!(
        config.trim_end().ends_with("retry_max_secs = 4"),
        "{config}"
    );
    config.push_str("mode = \"patch\"\n");
    std::fs::write(&n.config, config).unwrap();
    let token = format!("patcher-{}", n.name);
    n.server
        .add_token(&token, "system:serviceaccount:kube-system:edgehub");
    let kc = n.dir.path().join("kube/kubeconfig");
    let text = std::fs::read_to_string(&kc).unwrap();
    std::fs::write(&kc, text.replace(&format!("token-{}", n.name), &token)).unwrap();

    n.rolled_and_offline().await;
    let (code, _) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200);
    let end = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "Done", "{end}");
    let app = running_any(&n, "app").await[0].id.clone();
    n.server.set_offline(false).await.unwrap();
    n.wait_for(60, "the pod object says what runs", |n| async move {
        n.server
            .get("pods", "vehicle", "telemetry-sv74m")
            .is_some_and(|p| {
                p["metadata"]["labels"]["controller-revision-hash"] == "55778fbb9f"
                    && p["spec"]["containers"][0]["image"] == "127.0.0.1:5000/busybox:2.0"
            })
    })
    .await;
    let p = n.server.get("pods", "vehicle", "telemetry-sv74m").unwrap();
    assert_eq!(p["metadata"]["uid"], n.uid.as_str(), "the same pod object");
    n.wait_for(30, "PodNeedUpgrade False, from the cache", |n| async move {
        n.need()
            .is_some_and(|c| c["status"] == "False" && c["reason"] == "RunningLatestRevision")
    })
    .await;
    assert_eq!(running_any(&n, "app").await[0].id, app, "nothing restarted");
    assert_eq!(
        n.server
            .count(|r| r.method == "DELETE" && r.resource == "pods"),
        0,
        "nothing deleted"
    );
    n.clean().await;
}

/// Requests of this node that read Events (a GET, LIST or WATCH): a node may not, and the
/// fake refuses them with the recorded 403.
fn event_reads(n: &edge::Node) -> usize {
    n.server
        .count(|r| r.resource == "events" && matches!(r.verb, "get" | "list" | "watch"))
}

/// The outbox is empty: nothing queued, nothing parked.
fn drained(n: &edge::Node) -> bool {
    outbox(n).is_some_and(|o| o["queued"] == 0 && o["parked"] == Value::Array(vec![]))
}

/// Two attempts to upgrade the same pod object, both rolled back: the second attempt's
/// `UpgradeStarted` and `UpgradeRolledBack` have the names the first one's have, so the
/// apiserver answers their creates with 409. A node may not read Events (the fake answers a
/// GET or LIST with the recorded 403), so the series is kept on the device and PATCHed:
/// both reach the cloud with count 2, and nothing is parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_rollback_reaches_the_cloud_as_a_series_of_two() {
    let mut n = node("series").await;
    n.rolled_to_and_offline(Some("127.0.0.1:5000/busybox:3.0-crash"))
        .await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let first = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(first["state"], "RolledBack", "{first}");
    n.server.set_offline(false).await.unwrap();
    n.wait_for(60, "the first attempt's Events, count 1", |n| async move {
        ["upgradestarted", "upgraderolledback"]
            .iter()
            .all(|r| event(n, "telemetry-sv74m", r).is_some_and(|e| e["count"] == 1))
    })
    .await;

    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let first_id = first["id"].clone();
    n.wait_for(60, "the second attempt rolls back", |n| {
        let first_id = first_id.clone();
        async move {
            n.state()
                .is_some_and(|s| s["id"] != first_id && s["state"] == "RolledBack")
        }
    })
    .await;
    let second = n.state().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(["upgradestarted", "upgraderolledback"]
        .iter()
        .all(|r| event(&n, "telemetry-sv74m", r).is_some_and(|e| e["count"] == 2))
        && drained(&n))
    {
        assert!(
            Instant::now() < deadline,
            "the second attempt's Events never became a series of 2:\n{:#}\n{:#}\noutbox: {:?}\nrows: {:#?}\n{}",
            event(&n, "telemetry-sv74m", "upgradestarted").unwrap_or_default(),
            event(&n, "telemetry-sv74m", "upgraderolledback").unwrap_or_default(),
            outbox(&n),
            outbox_rows(&n),
            n.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let started = event(&n, "telemetry-sv74m", "upgradestarted").unwrap();
    assert!(
        started["message"]
            .as_str()
            .unwrap_or("")
            .ends_with(&format!("(request {})", second["id"])),
        "the series carries the latest message: {started}"
    );
    assert!(
        started["lastTimestamp"].as_str() >= started["firstTimestamp"].as_str(),
        "{started}"
    );
    assert_eq!(event_reads(&n), 0, "a node never reads Events");
    assert_eq!(
        n.server
            .count(|r| r.resource == "events" && r.verb == "create" && r.status == 201),
        2,
        "one create per series"
    );
    n.clean().await;
}

/// The create of an Event lands and its answer is lost on the way back. Tried again, the
/// create is a 409; the Event already holds this delivery's count, so the series' own
/// record PATCHes it to the same count: 1, not 2, and nothing is parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_whose_create_answer_was_lost_is_counted_once() {
    let mut n = node("lostcreate").await;
    n.rolled_and_offline().await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let end = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "Done", "{end}");
    n.server.lose_next_answers(1, "POST", &["/events"]);
    n.server.set_offline(false).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(["upgradestarted", "upgradesucceeded"]
        .iter()
        .all(|r| event(&n, "telemetry-sv74m", r).is_some())
        && drained(&n))
    {
        assert!(
            Instant::now() < deadline,
            "the Events were not delivered:\noutbox: {:?}\nrows: {:#?}\n{}",
            outbox(&n),
            outbox_rows(&n),
            n.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        n.server
            .count(|r| r.resource == "events" && r.answer_lost && r.status == 201),
        1,
        "a create landed without an answer"
    );
    for r in ["upgradestarted", "upgradesucceeded"] {
        let ev = event(&n, "telemetry-sv74m", r).unwrap();
        assert_eq!(ev["count"], 1, "{ev}");
    }
    assert_eq!(event_reads(&n), 0, "a node never reads Events");
    n.clean().await;
}

/// Appends `line` to the config's last table, `[report]`.
fn report_config(n: &edge::Node, line: &str) {
    let mut config = std::fs::read_to_string(&n.config).unwrap();
    assert!(
        config.trim_end().ends_with("retry_max_secs = 4"),
        "{config}"
    );
    config.push_str(line);
    config.push('\n');
    std::fs::write(&n.config, config).unwrap();
}

/// The pod object's DELETE lands, its answer is lost, and the link stays down from that
/// moment, before any watch could tell of the deletion, for longer than the adopt timeout.
/// The sandbox still awaits its replacement (an answer that never came is not a refusal),
/// and the adopt timeout counts from when the deletion was seen, not from the DELETE: when
/// the link returns, the replacement adopts the upgraded container and nothing restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_delete_answer_and_a_long_outage_still_end_in_adoption() {
    let mut n = node("lostdelete").await;
    let adopt_timeout = Duration::from_secs(6);
    report_config(
        &n,
        &format!("adopt_timeout_secs = {}", adopt_timeout.as_secs()),
    );
    n.rolled_and_offline().await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let end = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "Done", "{end}");
    let app = running_any(&n, "app").await;
    assert_eq!(app.len(), 1);
    let app_id = app[0].id.clone();
    let started = n
        .cri
        .container_status(&app_id)
        .await
        .unwrap()
        .unwrap()
        .started_at;

    n.server
        .lose_next_answer_and_stall("DELETE", &["/pods/telemetry-sv74m"]);
    n.server.set_offline(false).await.unwrap();
    n.wait_for(60, "the DELETE lands, unanswered", |n| async move {
        n.server
            .count(|r| r.method == "DELETE" && r.answer_lost && r.status == 200)
            == 1
    })
    .await;
    let landed = n
        .server
        .requests()
        .iter()
        .find(|r| r.method == "DELETE" && r.answer_lost)
        .map(|r| r.at)
        .unwrap();
    // The scenario's outage: the link stays down for longer than the adopt timeout. Time
    // passing is the precondition here, not what is asserted; the stalled fake tells no
    // watch of the deletion meanwhile (it stalls before the DELETE commits).
    tokio::time::sleep_until((landed + adopt_timeout + Duration::from_secs(3)).into()).await;
    // Meanwhile the DaemonSet controller replaced the pod; the link returns.
    replace_when_deleted(&n);
    n.server.stall(false);

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let reported = n
            .server
            .get("pods", "vehicle", "telemetry-x7k2p")
            .and_then(|p| {
                p["status"]["containerStatuses"]
                    .as_array()?
                    .iter()
                    .find(|c| c["name"] == "app")
                    .cloned()
            })
            .unwrap_or(Value::Null);
        if reported["containerID"] == format!("containerd://{app_id}").as_str()
            && reported["ready"] == true
        {
            break;
        }
        let running: Vec<String> = running_any(&n, "app")
            .await
            .iter()
            .map(|c| format!("{} {:?}", c.id, c.labels))
            .collect();
        assert!(
            Instant::now() < deadline,
            "the replacement did not adopt {app_id}: it reports {reported}\nrunning: {running:#?}\n{}",
            n.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let now = running_any(&n, "app").await;
    assert_eq!(now.len(), 1, "one revision runs");
    assert_eq!(now[0].id, app_id, "nothing restarted");
    let started_now = n
        .cri
        .container_status(&app_id)
        .await
        .unwrap()
        .unwrap()
        .started_at;
    assert_eq!(started_now, started, "same start time");
    n.clean().await;
}

/// The operator rolls on while the revision is reported: the pod object is deleted, and the
/// DaemonSet controller's replacement comes at a third revision. The upgraded sandbox can
/// never be adopted, so it is stopped at once, not after the adopt timeout (600 s), and the
/// replacement runs alone at its own revision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replacement_at_another_revision_stops_the_upgraded_sandbox_at_once() {
    let mut n = node("otherhash").await;
    n.rolled_and_offline().await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let end = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "Done", "{end}");
    n.server.set_offline(false).await.unwrap();
    n.wait_for(60, "edgehub deletes the pod object", |n| async move {
        n.server.get("pods", "vehicle", "telemetry-sv74m").is_none()
    })
    .await;
    // Back to the old image, under a revision of its own.
    let hash = edge::third_revision(&n.server, "127.0.0.1:5000/busybox:1.0");
    let ds = n.server.get("daemonsets", "vehicle", "telemetry").unwrap();
    let cr = n
        .server
        .get(
            "controllerrevisions",
            "vehicle",
            &format!("telemetry-{hash}"),
        )
        .unwrap();
    let replacement = n.server.apply("pods", pod_for(&ds, &cr, &n.name, "x7k2p"));
    let uid = replacement["metadata"]["uid"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let app = running_any(&n, "app").await;
        let pod_uid = |c: &edgehub::cri::api::Container| {
            c.labels
                .get(edgehub::cri::labels::POD_UID)
                .cloned()
                .unwrap_or_default()
        };
        if app.len() == 1
            && pod_uid(&app[0]) == uid
            && app[0].image.as_ref().map(|i| i.image.as_str()) == Some("127.0.0.1:5000/busybox:1.0")
            && n.sandboxes().await.len() == 1
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the upgraded sandbox still runs beside the replacement: {:#?}\nsandboxes: {:?}\n{}",
            app.iter()
                .map(|c| format!("{} {} {:?}", c.id, pod_uid(c), c.image))
                .collect::<Vec<_>>(),
            n.sandboxes().await,
            n.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    n.clean().await;
}

/// No replacement comes (no DaemonSet controller runs here): the upgraded sandbox waits the
/// adopt timeout, counted from when the deletion was seen, and is then stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_replacement_the_sandbox_is_stopped_after_the_adopt_timeout() {
    let mut n = node("noreplacement").await;
    let adopt_timeout = Duration::from_secs(4);
    report_config(
        &n,
        &format!("adopt_timeout_secs = {}", adopt_timeout.as_secs()),
    );
    n.rolled_and_offline().await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let end = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "Done", "{end}");
    n.server.set_offline(false).await.unwrap();
    n.wait_for(
        60,
        "edgehub's cache sees the pod object go",
        |n| async move {
            n.server.get("pods", "vehicle", "telemetry-sv74m").is_none()
                && cached_pod(n, "telemetry-sv74m").is_none()
        },
    )
    .await;
    n.wait_for(60, "the upgraded sandbox is stopped", |n| async move {
        n.sandboxes().await.is_empty()
    })
    .await;
    let deleted_at = n
        .server
        .requests()
        .iter()
        .find(|r| r.method == "DELETE" && r.resource == "pods")
        .map(|r| r.at)
        .unwrap();
    assert!(
        deleted_at.elapsed() >= adopt_timeout,
        "stopped {:?} after the DELETE, before the adopt timeout",
        deleted_at.elapsed()
    );
    n.clean().await;
}

/// The node's credential stops working (401) while reports are queued, as when it lapsed
/// offline, and works again later (renewed). A 401 says nothing about the report: every row
/// stays queued, none is parked, and once the credential works everything is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_401_period_every_queued_report_is_delivered() {
    let mut n = node("unauth").await;
    n.rolled_and_offline().await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let end = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "Done", "{end}");
    n.wait_for(30, "a status and the Events are queued", |n| async move {
        let q = n.queued_event_reasons();
        q.contains(&"UpgradeStarted".to_string())
            && q.contains(&"UpgradeSucceeded".to_string())
            && outbox(n).is_some_and(|o| o["queued"].as_u64().unwrap_or(0) >= 3)
    })
    .await;

    let token = format!("token-{}", n.name);
    n.server.remove_token(&token);
    n.server.set_offline(false).await.unwrap();
    // The outbox tries, is refused, and tries again: a 401 is not a verdict on the report.
    let report = |r: &edgehub_testsupport::apiserver::LoggedRequest| {
        r.status == 401 && matches!(r.resource.as_str(), "events" | "pods/status")
    };
    n.wait_for(60, "the outbox is refused twice", |n| async move {
        n.server.count(report) >= 2
    })
    .await;
    let o = outbox(&n).unwrap();
    assert_eq!(
        o["parked"],
        Value::Array(vec![]),
        "nothing parked for a 401: {o}\nrows: {:#?}",
        outbox_rows(&n)
    );

    // The credential works again.
    n.server
        .add_token(&token, &format!("system:node:{}", n.name));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(["upgradestarted", "upgradesucceeded"]
        .iter()
        .all(|r| event(&n, "telemetry-sv74m", r).is_some_and(|e| e["count"] == 1))
        && n.server.count(|r| {
            r.resource == "pods/status" && r.path.contains("telemetry-sv74m") && r.status == 200
        }) >= 1
        && drained(&n))
    {
        replace_when_deleted(&n);
        assert!(
            Instant::now() < deadline,
            "not everything was delivered after the 401s:\noutbox: {:?}\nrows: {:#?}\n{}",
            outbox(&n),
            outbox_rows(&n),
            n.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    n.clean().await;
}

/// A report the apiserver refused for good is parked, and tried again on its own, with
/// backoff: a refusal that passes (here a 400 the apiserver gave once) does not lose it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_report_is_tried_again_on_its_own() {
    let mut n = node("parkretry").await;
    n.rolled_and_offline().await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let end = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "Done", "{end}");
    n.server.fail_next(1, 400, None, &["/events"]);
    n.server.set_offline(false).await.unwrap();
    n.wait_for(30, "an Event is parked", |n| async move {
        outbox(n).is_some_and(|o| {
            o["parked"]
                .as_array()
                .is_some_and(|p| p.iter().any(|r| r["kind"] == "event"))
        })
    })
    .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(["upgradestarted", "upgradesucceeded"]
        .iter()
        .all(|r| event(&n, "telemetry-sv74m", r).is_some_and(|e| e["count"] == 1))
        && outbox(&n).is_some_and(|o| o["parked"] == Value::Array(vec![])))
    {
        assert!(
            Instant::now() < deadline,
            "the parked Event was never tried again:\noutbox: {:?}\nrows: {:#?}",
            outbox(&n),
            outbox_rows(&n),
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    n.clean().await;
}

/// Offline, the sidecar crashes (a status is queued), then the pod is upgraded (its Events
/// are queued), then its status changes again (the new image). When the link returns the
/// apiserver hears it in that order: the Events before the status that came after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_queued_again_reaches_the_cloud_after_the_events_before_it() {
    let mut n = node("order").await;
    n.rolled_and_offline().await;
    let sidecar = n.running("sidecar").await[0].id.clone();
    n.cri.stop_container(&sidecar, 0).await.unwrap();
    n.wait_for(30, "the crash's status is queued", |n| async move {
        outbox(n).is_some_and(|o| o["queued"].as_u64().unwrap_or(0) >= 1)
    })
    .await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let end = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "Done", "{end}");
    n.wait_for(30, "the upgraded status is queued", |n| async move {
        let Some(conn) = rusqlite::Connection::open_with_flags(
            n.dir.path().join("data/edgehub.db"),
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        )
        .ok() else {
            return false;
        };
        conn.query_row("SELECT body FROM outbox WHERE kind = 'status'", [], |r| {
            r.get::<_, String>(0)
        })
        .is_ok_and(|b| b.contains("127.0.0.1:5000/busybox:2.0"))
    })
    .await;
    n.server.clear_log();
    n.server.set_offline(false).await.unwrap();
    n.wait_for(60, "everything is delivered", |n| async move {
        event(n, "telemetry-sv74m", "upgradesucceeded").is_some()
            && n.server.count(|r| {
                r.resource == "pods/status" && r.path.contains("telemetry-sv74m") && r.status == 200
            }) >= 1
    })
    .await;
    let log = n.server.requests();
    let first = |f: &dyn Fn(&edgehub_testsupport::apiserver::LoggedRequest) -> bool| {
        log.iter().position(f).unwrap()
    };
    let status = first(&|r| {
        r.resource == "pods/status" && r.path.contains("telemetry-sv74m") && r.status == 200
    });
    let started = first(&|r| r.resource == "events" && r.verb == "create" && r.status == 201);
    assert!(
        started < status,
        "UpgradeStarted (request {started}) before the status queued after it (request {status}): {:#?}",
        log.iter()
            .map(|r| format!("{} {} {}", r.method, r.path, r.status))
            .collect::<Vec<_>>()
    );
    n.clean().await;
}
