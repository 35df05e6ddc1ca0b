//! The reflectors against the fake apiserver over real TLS, with a real SQLite file.

mod common;

use common::{wait_until, Harness};
use edgehub::link::LinkState;
use edgehub::object::Kind;
use edgehub_testsupport::fixture_body;
use serde_json::json;
use std::time::Duration;

fn bump_pod(h: &Harness, name: &str, marker: &str) -> String {
    let p = h.server.modify("pods", "vehicle", name, |p| {
        p["metadata"]["annotations"]["test/marker"] = json!(marker);
    });
    p["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn fresh_sync_fills_the_cache_with_the_raw_objects() {
    let mut h = Harness::new().await;
    h.start();
    h.wait_converged().await;
    assert_eq!(h.count(Kind::Pod), 2);
    assert_eq!(h.count(Kind::DaemonSet), 2);
    assert_eq!(h.count(Kind::ControllerRevision), 2);
    assert_eq!(h.count(Kind::Node), 1);

    // Objects are stored byte for byte as the list response carried them.
    let listed = fixture_body("pods_list_node");
    let want = serde_json::to_string(&listed["items"][1]).unwrap();
    let stored = h
        .store()
        .get(Kind::Pod, "vehicle", "telemetry-sv74m")
        .unwrap()
        .unwrap();
    assert_eq!(stored.raw, want);
    assert_eq!(
        stored.index.revision_hash.as_deref(),
        Some(
            listed["items"][1]["metadata"]["labels"]["controller-revision-hash"]
                .as_str()
                .unwrap()
        )
    );
    assert_eq!(stored.index.owner_kind.as_deref(), Some("DaemonSet"));
    assert_eq!(*h.sync().link.borrow(), LinkState::Online);

    // Pods were selected by node; DaemonSets and revisions are listed once each.
    assert!(
        h.server.count(|r| r.is_list_of("pods")
            && r.query.get("fieldSelector").map(String::as_str) == Some("spec.nodeName=edge-1"))
            >= 1
    );
    assert_eq!(h.lists_of("daemonsets"), 1);
    assert_eq!(h.lists_of("controllerrevisions"), 1);
    wait_until(10, "all four reflectors watch with bookmarks", || {
        h.server.count(|r| {
            r.is_watch() && r.query.get("allowWatchBookmarks").map(String::as_str) == Some("true")
        }) >= 4
    })
    .await;

    // A new revision arrives through the watch.
    let rev2 = fixture_body("controllerrevisions_list_rev2");
    for item in rev2["items"].as_array().unwrap() {
        h.server.apply("controllerrevisions", item.clone());
    }
    h.wait_converged().await;
    assert_eq!(h.count(Kind::ControllerRevision), 3);
    h.stop().await;
}

#[tokio::test]
async fn restart_resumes_the_watch_without_a_relist() {
    let mut h = Harness::new().await;
    h.start();
    h.wait_converged().await;
    h.stop().await;
    let lists_before = h.lists_of("pods");

    // Changes while edgehub is down are replayed by the resumed watch.
    bump_pod(&h, "telemetry-sv74m", "while-down");
    h.server.remove("pods", "vehicle", "gateway-v9hb2");
    h.start();
    h.wait_converged().await;
    assert_eq!(h.count(Kind::Pod), 1);
    assert_eq!(
        h.lists_of("pods"),
        lists_before,
        "no second list after a restart"
    );
    assert_eq!(h.lists_of("daemonsets"), 1);
    let resumed = h.server.count(|r| {
        r.is_watch_of("pods") && r.query.get("resourceVersion").is_some_and(|v| v != "0")
    });
    assert!(
        resumed >= 2,
        "watches resumed from a stored resourceVersion"
    );
    h.stop().await;
}

#[tokio::test]
async fn expired_watch_relists_and_removes_what_was_deleted_while_away() {
    let mut h = Harness::new().await;
    h.start();
    h.wait_converged().await;
    h.stop().await;

    // While disconnected: a pod and a DaemonSet go away, and etcd compacts the history.
    h.server.remove("pods", "vehicle", "gateway-v9hb2");
    h.server.remove("daemonsets", "vehicle", "gateway");
    bump_pod(&h, "telemetry-sv74m", "after");
    h.server.compact();
    h.server.clear_log();

    h.start();
    h.wait_converged().await;
    assert!(h
        .store()
        .get(Kind::Pod, "vehicle", "gateway-v9hb2")
        .unwrap()
        .is_none());
    assert!(h
        .store()
        .get(Kind::DaemonSet, "vehicle", "gateway")
        .unwrap()
        .is_none());
    assert_eq!(h.count(Kind::Pod), 1);
    // Each resource got an ERROR 410 on its watch and listed again exactly once.
    assert_eq!(h.lists_of("pods"), 1);
    assert_eq!(h.lists_of("daemonsets"), 1);
    h.stop().await;
}

#[tokio::test]
async fn expired_continue_token_restarts_the_list() {
    let mut h = Harness::new().await;
    h.config.sync.list_page_size = 1;
    h.server.fail_next(1, 410, None, &["/pods?", "continue="]);
    h.start();
    h.wait_converged().await;
    let pod_lists: Vec<_> = h
        .server
        .requests()
        .into_iter()
        .filter(|r| r.is_list_of("pods"))
        .collect();
    let statuses: Vec<(u16, bool)> = pod_lists
        .iter()
        .map(|r| (r.status, r.query.contains_key("continue")))
        .collect();
    // page 1, page 2 -> 410, then page 1 and page 2 again.
    assert_eq!(
        statuses,
        [(200, false), (410, true), (200, false), (200, true)]
    );
    h.stop().await;
}

#[tokio::test]
async fn a_stream_cut_mid_event_is_replayed_from_the_last_version() {
    let mut h = Harness::new().await;
    h.start();
    h.wait_converged().await;
    let watches = h.watches_of("pods");
    let lists = h.lists_of("pods");
    h.server.cut_next_watch_events(1);
    let rv = bump_pod(&h, "telemetry-sv74m", "cut");
    wait_until(10, "the cut event is applied after a re-watch", || {
        h.stored_rv(Kind::Pod, "vehicle", "telemetry-sv74m")
            .as_deref()
            == Some(rv.as_str())
    })
    .await;
    assert!(h.watches_of("pods") > watches, "watched again");
    assert_eq!(
        h.lists_of("pods"),
        lists,
        "a cut stream does not cause a relist"
    );
    h.stop().await;
}

#[tokio::test]
async fn malformed_watch_lines_and_list_items_are_skipped() {
    let mut h = Harness::new().await;
    // A list item without a uid.
    h.server.seed_list(
        "pods",
        &json!({"metadata": {"resourceVersion": "1"}, "items": [
            {"metadata": {"name": "broken", "namespace": "vehicle", "resourceVersion": "1"}, "spec": {"nodeName": "edge-1"}}
        ]}),
    );
    h.start();
    wait_until(10, "the good pods are cached", || {
        h.store.is_some() && h.count(Kind::Pod) == 2
    })
    .await;
    assert!(h
        .store()
        .get(Kind::Pod, "vehicle", "broken")
        .unwrap()
        .is_none());

    h.server.corrupt_next_watch_events(1);
    let rv = bump_pod(&h, "telemetry-sv74m", "after-garbage");
    wait_until(10, "the event after the garbage line is applied", || {
        h.stored_rv(Kind::Pod, "vehicle", "telemetry-sv74m")
            .as_deref()
            == Some(rv.as_str())
    })
    .await;
    let st = h.sync().stats_for("pods").unwrap();
    assert!(st.malformed.load(std::sync::atomic::Ordering::Relaxed) >= 2);
    assert_eq!(h.lists_of("pods"), 1, "garbage does not break the stream");
    h.stop().await;
}

#[tokio::test]
async fn too_many_requests_waits_for_retry_after() {
    let mut h = Harness::new().await;
    h.server.fail_next(1, 429, Some(2), &["/pods?"]);
    h.start();
    h.wait_converged().await;
    let pods: Vec<_> = h
        .server
        .requests()
        .into_iter()
        .filter(|r| r.path.ends_with("/pods"))
        .collect();
    assert_eq!(pods[0].status, 429);
    let gap = pods[1].at.duration_since(pods[0].at);
    // backoff_max is 1 s in the test config, so only Retry-After explains a 2 s wait.
    assert!(gap >= Duration::from_millis(1900), "retried after {gap:?}");
    h.stop().await;
}

#[tokio::test]
async fn server_errors_back_off_and_recover() {
    let mut h = Harness::new().await;
    h.server.fail_next(3, 500, None, &["/daemonsets?"]);
    h.start();
    h.wait_converged().await;
    assert_eq!(
        h.server
            .count(|r| r.path.ends_with("/daemonsets") && r.status == 500),
        3
    );
    let st = h.sync().stats_for("daemonsets").unwrap();
    assert_eq!(st.errors.load(std::sync::atomic::Ordering::Relaxed), 3);
    h.stop().await;
}

#[tokio::test]
async fn link_goes_offline_and_back_and_catches_up() {
    let mut h = Harness::new().await;
    h.start();
    h.wait_converged().await;
    let mut link = h.sync().link.clone();

    h.server.set_offline(true).await.unwrap();
    // Changes in the cloud while the device is cut off.
    bump_pod(&h, "telemetry-sv74m", "offline");
    h.server.remove("pods", "vehicle", "gateway-v9hb2");
    tokio::time::timeout(
        Duration::from_secs(10),
        link.wait_for(|s| matches!(s, LinkState::Offline { .. })),
    )
    .await
    .expect("link reported offline")
    .unwrap();
    // The cache is still there to serve from.
    assert_eq!(h.count(Kind::Pod), 2);

    h.server.set_offline(false).await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        link.wait_for(|s| *s == LinkState::Online),
    )
    .await
    .expect("link reported online")
    .unwrap();
    h.wait_converged().await;
    assert_eq!(h.count(Kind::Pod), 1);
    h.stop().await;
}

#[tokio::test]
async fn a_stalled_watch_is_detected_and_restarted() {
    let mut h = Harness::new().await;
    h.start();
    h.wait_converged().await;
    let watches = h.watches_of("pods");
    h.server.stall(true);
    let mut link = h.sync().link.clone();
    tokio::time::timeout(
        Duration::from_secs(15),
        link.wait_for(|s| matches!(s, LinkState::Offline { .. })),
    )
    .await
    .expect("a silent watch is noticed by the idle timeout")
    .unwrap();
    // Wait for the pods watch itself to time out, not just any reflector's.
    let pod_stats = h.sync().stats_for("pods").unwrap().clone();
    wait_until(15, "the pods watch times out", || {
        pod_stats.errors.load(std::sync::atomic::Ordering::Relaxed) > 0
    })
    .await;
    h.server.stall(false);
    let rv = bump_pod(&h, "telemetry-sv74m", "after-stall");
    wait_until(15, "sync resumes after the stall", || {
        h.stored_rv(Kind::Pod, "vehicle", "telemetry-sv74m")
            .as_deref()
            == Some(rv.as_str())
    })
    .await;
    assert!(h.watches_of("pods") > watches);
    h.stop().await;
}

#[tokio::test]
async fn bookmarks_and_no_op_events_write_nothing() {
    let mut h = Harness::new().await;
    h.config.sync.cursor_checkpoint = Duration::from_secs(3600);
    h.server.set_bookmark_interval(Duration::from_millis(50));
    h.start();
    h.wait_converged().await;
    let events = |key: &str| {
        h.sync()
            .stats_for(key)
            .unwrap()
            .events
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    // Let every reflector see its first bookmark (after the list, nothing else comes), then
    // measure the WAL over many more.
    let keys: Vec<String> = h.sync().stats.iter().map(|(k, _)| k.clone()).collect();
    let settled: Vec<u64> = keys.iter().map(|k| events(k)).collect();
    wait_until(10, "every reflector got a bookmark", || {
        keys.iter().zip(&settled).all(|(k, n)| events(k) > *n)
    })
    .await;
    let wal = h.db_path().with_extension("db-wal");
    let size = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    let before = (size(&wal), size(&h.db_path()));
    let events_before = events("pods");
    // The proof that bookmarks came and went: ten more of them on the pods watch.
    wait_until(10, "ten more bookmarks on the pods watch", || {
        events("pods") >= events_before + 10
    })
    .await;
    assert_eq!(
        (size(&wal), size(&h.db_path())),
        before,
        "no bytes written for bookmarks"
    );
    // The seen version is still checkpointed at shutdown.
    h.stop().await;
    let store =
        edgehub::store::Store::open(&h.db_path(), edgehub::store::OpenMode::Normal).unwrap();
    let cursor: u64 = store
        .cursor("pods?fieldSelector=spec.nodeName=edge-1")
        .unwrap()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(cursor, h.server.resource_version());
}

#[tokio::test]
async fn client_certificate_authentication_works() {
    let mut h = Harness::new().await;
    let kc = h
        .server
        .write_cert_kubeconfig(&h.dir.path().join("certkube"), "system:node:edge-1")
        .unwrap();
    h.config.kubeconfig = kc;
    h.start();
    h.wait_converged().await;
    assert!(h
        .server
        .requests()
        .iter()
        .all(|r| r.user.as_deref() == Some("system:node:edge-1")));
    h.stop().await;
}

#[tokio::test]
async fn narrowing_the_selection_forgets_what_it_no_longer_covers() {
    let mut h = Harness::new().await;
    h.start();
    h.wait_converged().await;
    h.stop().await;
    h.config.sync.watch_namespaces = vec!["infra".into()];
    h.start();
    wait_until(10, "DaemonSets outside `infra` are forgotten", || {
        h.count(Kind::DaemonSet) == 0 && h.count(Kind::ControllerRevision) == 0
    })
    .await;
    wait_until(10, "the namespaced reflectors watch", || {
        h.server
            .count(|r| r.is_watch() && r.path.contains("/namespaces/infra/"))
            >= 2
    })
    .await;
    assert_eq!(
        h.count(Kind::Pod),
        2,
        "pods are selected by node, not namespace"
    );
    h.stop().await;
}

#[tokio::test]
async fn shutdown_does_not_wait_for_a_hanging_apiserver() {
    let mut h = Harness::new().await;
    h.server.stall(true);
    h.start();
    // Every reflector's list is at the server, hanging.
    let reflectors = h.sync().stats.len() as u64;
    wait_until(10, "every reflector's list hangs at the server", || {
        h.server.held_requests() >= reflectors
    })
    .await;
    let t = std::time::Instant::now();
    h.stop().await;
    // The request timeout is 3 s in the test config; stopping must not sit it out.
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "stop took {:?}",
        t.elapsed()
    );
    h.server.stall(false);
}

/// Requests since the log was cleared that were not watches, as (verb, resource) strings.
fn not_watches(h: &Harness) -> Vec<String> {
    h.server
        .requests()
        .into_iter()
        .filter(|r| !r.is_watch())
        .map(|r| format!("{} {}?{:?}", r.method, r.path, r.query))
        .collect()
}

/// A cut shorter than the watch window: once the link is back, every reflector resumes its
/// watch from its cursor and the changes made during the cut arrive through it. Nothing
/// else is sent: no list, and no `limit=1` version check before each watch (a fleet whose
/// link came back used to send one per resource per device).
#[tokio::test]
async fn a_short_cut_resumes_every_watch_and_sends_nothing_else() {
    let mut h = Harness::new().await;
    h.start();
    h.wait_converged().await;
    wait_until(10, "the four watches are open", || {
        ["pods", "nodes", "daemonsets", "controllerrevisions"]
            .iter()
            .all(|p| h.watches_of(p) >= 1)
    })
    .await;

    h.server.set_offline(true).await.unwrap();
    wait_until(10, "the reflectors saw the link go", || {
        *h.sync().link.borrow() != LinkState::Online
    })
    .await;
    let rv = bump_pod(&h, "telemetry-sv74m", "during-the-cut");
    h.server.clear_log();
    h.server.set_offline(false).await.unwrap();
    wait_until(15, "the change made during the cut arrives", || {
        h.stored_rv(Kind::Pod, "vehicle", "telemetry-sv74m")
            .as_deref()
            == Some(rv.as_str())
    })
    .await;
    h.wait_converged().await;
    wait_until(10, "every watch resumed", || {
        ["pods", "nodes", "daemonsets", "controllerrevisions"]
            .iter()
            .all(|p| h.watches_of(p) >= 1)
    })
    .await;
    assert_eq!(not_watches(&h), Vec::<String>::new(), "only watches");
    assert!(
        h.server
            .requests()
            .iter()
            .all(|r| r.query.get("resourceVersion").is_some_and(|v| v != "0")),
        "each watch resumed from a cursor"
    );
    h.stop().await;
}

/// A cut longer than the watch window: the history the cursors point into is compacted
/// meanwhile, so each resumed watch gets the apiserver's one ERROR event, 410 "too old
/// resource version", and its reflector lists again, node-scoped, once, with no version
/// check first; what was deleted during the cut is gone from the cache.
#[tokio::test]
async fn a_cut_past_the_watch_window_relists_on_the_410() {
    let mut h = Harness::new().await;
    h.start();
    h.wait_converged().await;
    h.server.set_offline(true).await.unwrap();
    wait_until(10, "the reflectors saw the link go", || {
        *h.sync().link.borrow() != LinkState::Online
    })
    .await;
    h.server.remove("pods", "vehicle", "gateway-v9hb2");
    bump_pod(&h, "telemetry-sv74m", "during-the-cut");
    h.server.compact();
    h.server.clear_log();
    h.server.set_offline(false).await.unwrap();
    h.wait_converged().await;
    assert!(h
        .store()
        .get(Kind::Pod, "vehicle", "gateway-v9hb2")
        .unwrap()
        .is_none());
    wait_until(10, "every resource listed again", || {
        ["pods", "nodes", "daemonsets", "controllerrevisions"]
            .iter()
            .all(|p| h.lists_of(p) == 1)
    })
    .await;
    let first_pod_requests: Vec<(bool, u16)> = h
        .server
        .requests()
        .into_iter()
        .filter(|r| r.path.ends_with("/pods"))
        .take(2)
        .map(|r| (r.is_watch(), r.status))
        .collect();
    assert_eq!(
        first_pod_requests,
        [(true, 200), (false, 200)],
        "the watch (its 410 comes as an event), then the list"
    );
    assert_eq!(
        h.server
            .count(|r| r.query.contains_key("resourceVersionMatch")),
        0,
        "no version check"
    );
    h.stop().await;
}

/// After an etcd restore from a backup the apiserver's versions go back, and edgehub's
/// cursor is ahead of them. A watch from it is accepted and stays silent (the server sends
/// nothing, not even bookmarks, until its own versions pass the cursor, and what changed in
/// between is never sent); only a version check answers 504 "Too large resource version".
/// edgehub must notice and list again, node-scoped, so the cache equals the server.
#[tokio::test]
async fn a_cache_ahead_of_a_restored_server_is_corrected_by_a_list() {
    let mut h = Harness::new().await;
    h.start();
    h.wait_converged().await;
    let backup = h.server.snapshot();

    // After the backup the cluster moves on, and edgehub follows: a pod changes, one is added.
    bump_pod(&h, "telemetry-sv74m", "after-the-backup");
    let mut late = h.server.get("pods", "vehicle", "gateway-v9hb2").unwrap();
    late["metadata"] = json!({"name": "late", "namespace": "vehicle"});
    h.server.apply("pods", late);
    h.wait_converged().await;
    let cursor: u64 = h
        .store()
        .cursor("pods?fieldSelector=spec.nodeName=edge-1")
        .unwrap()
        .unwrap()
        .parse()
        .unwrap();

    // The restore (the apiserver restarts), then the cluster moves on from the backup: the
    // gateway pod is deleted, at a version still below edgehub's cursor.
    h.server.restore(&backup);
    h.server.remove("pods", "vehicle", "gateway-v9hb2");
    assert!(h.server.resource_version() < cursor);
    let lists_before = h.lists_of("pods");
    h.wait_converged().await;
    assert_eq!(h.count(Kind::Pod), 1, "only telemetry, as restored");
    assert!(h
        .store()
        .get(Kind::Pod, "vehicle", "late")
        .unwrap()
        .is_none());
    assert!(
        h.server
            .count(|r| r.is_version_check_of("pods") && r.status == 504)
            >= 1,
        "the cursor check got the 504"
    );
    assert_eq!(
        h.lists_of("pods"),
        lists_before + 1,
        "one node-scoped relist"
    );
    assert!(h.server.requests().iter().any(|r| r.is_list_of("pods")
        && r.query.get("fieldSelector").map(String::as_str) == Some("spec.nodeName=edge-1")
        && !r.query.contains_key("resourceVersion")));
    h.stop().await;
}

/// The fake answers a version it does not have as the real apiserver does (k8s.io/apiserver
/// v1.36): a list with `NotOlderThan` waits 3 s, then 504 Timeout with the
/// `ResourceVersionTooLarge` cause and `retryAfterSeconds: 1`; `Exact` is the same 504 at
/// once; a plain watch is accepted and silent; a watch list ends with that Status as an
/// ERROR event.
#[tokio::test]
async fn the_fake_answers_a_future_resource_version_as_the_apiserver_does() {
    let h = Harness::new().await;
    let future = h.server.resource_version() + 100;
    let tok = Some(edgehub_testsupport::NODE_TOKEN);
    let pods = "/api/v1/pods?fieldSelector=spec.nodeName%3Dedge-1";
    let t = std::time::Instant::now();
    let (code, body) = h
        .server
        .raw(
            tok,
            "GET",
            &format!("{pods}&limit=1&resourceVersion={future}&resourceVersionMatch=NotOlderThan"),
            None,
            None,
        )
        .await
        .unwrap();
    assert!(
        t.elapsed() >= Duration::from_secs(3),
        "the watch cache waited"
    );
    assert_eq!(code, 504);
    let current = h.server.resource_version();
    assert_eq!(
        body,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("Timeout: Too large resource version: {future}, current: {current}"),
            "reason": "Timeout",
            "details": {"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                "retryAfterSeconds": 1},
            "code": 504})
    );
    let (code, body) = h
        .server
        .raw(
            tok,
            "GET",
            &format!("{pods}&resourceVersion={future}&resourceVersionMatch=Exact"),
            None,
            None,
        )
        .await
        .unwrap();
    assert_eq!(
        (code, &body["details"]["retryAfterSeconds"]),
        (504, &json!(0))
    );
    // A version it has is served as usual.
    let (code, _) = h
        .server
        .raw(
            tok,
            "GET",
            &format!("{pods}&limit=1&resourceVersion={current}&resourceVersionMatch=NotOlderThan"),
            None,
            None,
        )
        .await
        .unwrap();
    assert_eq!(code, 200);

    // Watches, with bookmarks every 50 ms: while the one from the server's version gets
    // twenty of them, the one from the future gets nothing.
    h.server.set_bookmark_interval(Duration::from_millis(50));
    let watch = |rv: u64| format!("{pods}&watch=1&allowWatchBookmarks=true&resourceVersion={rv}");
    let (now_path, ahead_path) = (watch(current), watch(future));
    let ahead = h
        .server
        .raw_watch(tok, &ahead_path, 1, Duration::from_secs(60));
    let now = h
        .server
        .raw_watch(tok, &now_path, 20, Duration::from_secs(30));
    tokio::select! {
        now = now => {
            let (code, events) = now.unwrap();
            assert_eq!(code, 200);
            assert!(events.len() == 20 && events.iter().all(|e| e["type"] == "BOOKMARK"), "{events:?}");
        }
        ahead = ahead => panic!("the watch from the future got something first: {ahead:?}"),
    }
    let (code, events) = h
        .server
        .raw_watch(
            tok,
            &format!(
                "{}&sendInitialEvents=true&resourceVersionMatch=NotOlderThan",
                watch(future)
            ),
            5,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert_eq!(code, 200);
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["type"], "ERROR");
    assert_eq!(events[0]["object"]["code"], 504);
    assert_eq!(
        events[0]["object"]["details"]["causes"][0]["reason"],
        "ResourceVersionTooLarge"
    );
}
