//! The runtime against the in-memory CRI fake: what a pass does, end to end, without a
//! container runtime. The real-containerd tests are in tests/runtime.rs.

use super::*;
use crate::cri::fake::FakeCri;
use crate::cri::{api, labels};
use crate::store::{Change, OpenMode};

fn pod(name: &str, image: &str) -> StoredObject {
    let raw = serde_json::json!({
        "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"), "resourceVersion": "1",
            "ownerReferences": [{"kind": "DaemonSet", "uid": "ds", "controller": true}]},
        "spec": {"hostNetwork": true, "containers": [{"name": "app", "image": image, "imagePullPolicy": "IfNotPresent"}]},
    });
    StoredObject::from_raw(Kind::Pod, raw.to_string()).unwrap()
}

fn setup() -> (tempfile::TempDir, Arc<Store>, Reconciler<FakeCri>) {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("db"), OpenMode::Normal).unwrap());
    let mut r = Reconciler::new(
        FakeCri::default(),
        store.clone(),
        None,
        dir.path().to_path_buf(),
        "n1".into(),
    );
    // The cache has seen a pod list, as after a first sync: it may say what must not run.
    store
        .set_cursor(&crate::sync::pods_cursor_key("n1"), "1")
        .unwrap();
    r.backoff = BackoffPolicy {
        initial: Duration::from_millis(1),
        max: Duration::from_millis(2),
    };
    (dir, store, r)
}

fn running(r: &Reconciler<FakeCri>) -> usize {
    let s = r.cri.state.lock().unwrap();
    s.containers
        .values()
        .filter(|c| c.state == api::ContainerState::ContainerRunning as i32)
        .count()
}

#[tokio::test]
async fn creates_once_pulls_once_and_is_idempotent() {
    let (_d, store, mut r) = setup();
    store
        .apply(
            Kind::Pod,
            &[
                Change::Upsert(pod("a", "img:1")),
                Change::Upsert(pod("b", "img:1")),
            ],
            None,
        )
        .unwrap();
    let p = r.reconcile().await.unwrap();
    assert_eq!((p.sandboxes_created, p.containers_started), (2, 2));
    assert_eq!(running(&r), 2);
    assert_eq!(
        r.cri.state.lock().unwrap().pulls,
        ["img:1"],
        "IfNotPresent pulls once"
    );
    let p = r.reconcile().await.unwrap();
    assert_eq!(
        (
            p.sandboxes_created,
            p.containers_started,
            p.containers_restarted
        ),
        (0, 0, 0)
    );
}

#[tokio::test]
async fn an_exited_container_waits_its_backoff_then_gets_the_next_attempt() {
    let (_d, store, mut r) = setup();
    store
        .apply(Kind::Pod, &[Change::Upsert(pod("a", "img:1"))], None)
        .unwrap();
    r.reconcile().await.unwrap();
    let id = r
        .cri
        .state
        .lock()
        .unwrap()
        .containers
        .keys()
        .next()
        .unwrap()
        .clone();
    r.cri.exit(&id);
    let p = r.reconcile().await.unwrap();
    assert_eq!(
        p.containers_restarted, 0,
        "the first pass only schedules the restart"
    );
    tokio::time::sleep(Duration::from_millis(5)).await;
    let p = r.reconcile().await.unwrap();
    assert_eq!(p.containers_restarted, 1);
    let s = r.cri.state.lock().unwrap();
    let c = s.containers.values().next().unwrap();
    assert_eq!(c.metadata.as_ref().unwrap().attempt, 1);
    assert_eq!(c.state, api::ContainerState::ContainerRunning as i32);
}

#[tokio::test]
async fn removed_pods_go_and_foreign_objects_stay() {
    let (_d, store, mut r) = setup();
    store
        .apply(Kind::Pod, &[Change::Upsert(pod("a", "img:1"))], None)
        .unwrap();
    r.reconcile().await.unwrap();
    let foreign = r
        .cri
        .run_pod_sandbox(api::PodSandboxConfig {
            labels: HashMap::from([(labels::MANAGED_BY.to_string(), "edgehub".to_string())]),
            ..Default::default()
        })
        .await
        .unwrap();
    store
        .apply(
            Kind::Pod,
            &[Change::Delete {
                namespace: "ns".into(),
                name: "a".into(),
            }],
            None,
        )
        .unwrap();
    let p = r.reconcile().await.unwrap();
    assert_eq!(p.pods_removed, 1);
    let s = r.cri.state.lock().unwrap();
    assert_eq!(
        s.sandboxes.keys().collect::<Vec<_>>(),
        [&foreign],
        "another node's sandbox is not ours"
    );
    assert!(s.containers.is_empty());
}

#[tokio::test]
async fn status_is_queued_without_an_apiserver() {
    let (_d, store, mut r) = setup();
    store
        .apply(Kind::Pod, &[Change::Upsert(pod("a", "img:1"))], None)
        .unwrap();
    r.reconcile().await.unwrap();
    r.reconcile().await.unwrap();
    let q = store.queued_statuses().unwrap();
    assert_eq!(q.len(), 1);
    let v: Value = serde_json::from_str(&q[0].status).unwrap();
    assert_eq!(v["phase"], "Running");
    assert_eq!(v["containerStatuses"][0]["imageID"], "fake@sha256:1");
}

#[tokio::test]
async fn a_volume_the_host_refuses_is_failed_mount_and_the_others_run() {
    let (dir, store, mut r) = setup();
    let mut bad: Value = serde_json::from_str(&pod("bad", "img:1").raw).unwrap();
    // A hostPath that must be a file but is a directory.
    bad["spec"]["volumes"] = serde_json::json!([{"name": "f", "hostPath": {
        "path": dir.path().display().to_string(), "type": "File"}}]);
    let bad = StoredObject::from_raw(Kind::Pod, bad.to_string()).unwrap();
    store
        .apply(
            Kind::Pod,
            &[Change::Upsert(bad), Change::Upsert(pod("good", "img:1"))],
            None,
        )
        .unwrap();
    let pass = r.reconcile().await.unwrap();
    assert!(pass.unsupported.is_empty(), "{pass:?}");
    assert_eq!(pass.failed.len(), 1, "{pass:?}");
    assert!(pass.failed[0].1.contains("is not a File"), "{pass:?}");
    assert_eq!(pass.containers_started, 1, "the good pod runs");
    let q = store.queued_statuses().unwrap();
    let bad_status = q.iter().find(|s| s.name == "bad").unwrap();
    let v: Value = serde_json::from_str(&bad_status.status).unwrap();
    assert_eq!(v["conditions"][0]["reason"], "FailedMount");
    assert_eq!(store.queued_events().unwrap().len(), 1);
}

#[tokio::test]
async fn a_status_the_outbox_dropped_is_queued_again() {
    let (_d, store, mut r) = setup();
    store
        .apply(Kind::Pod, &[Change::Upsert(pod("a", "img:1"))], None)
        .unwrap();
    r.reconcile().await.unwrap();
    r.reconcile().await.unwrap();
    assert_eq!(store.queued_statuses().unwrap().len(), 1);
    // The sender drops it (the Node authorizer kept answering "no relationship found"); the
    // pod is still cached and its status still not in the cloud.
    let row = store.outbox().unwrap().remove(0);
    store.outbox_drop(row.id).unwrap();
    r.reconcile().await.unwrap();
    assert_eq!(
        store.queued_statuses().unwrap().len(),
        1,
        "the runtime's copy of the queue follows the outbox"
    );
}

#[test]
fn owed_warnings_keep_one_per_pod_and_reason_and_count_every_occurrence() {
    let mut owed = Owed::default();
    assert!(owed.is_empty());
    let (a, b) = (pod("a", "img:1"), pod("b", "img:1"));
    owed.warning(&a, "Unhealthy", "first", "t1".into(), 1);
    owed.warning(&a, "Unhealthy", "second", "t2".into(), 1);
    owed.warning(&a, "ErrImagePull", "pull", "t3".into(), 2);
    owed.warning(&b, "Unhealthy", "other pod", "t4".into(), 1);
    assert_eq!(owed.warnings.len(), 3);
    let w = &owed.warnings[&("uid-a".to_string(), "Unhealthy".to_string())];
    assert_eq!(
        (w.message.as_str(), w.at.as_str(), w.times),
        ("second", "t2", 2)
    );
    assert_eq!(
        owed.warnings[&("uid-a".to_string(), "ErrImagePull".to_string())].times,
        2
    );
    assert!(!owed.is_empty());
}

#[tokio::test]
async fn a_probe_that_changes_no_verdict_changes_nothing_else() {
    let (_d, store, mut r) = setup();
    store
        .apply(Kind::Pod, &[Change::Upsert(pod("a", "img:1"))], None)
        .unwrap();
    r.reconcile().await.unwrap();
    let probe = || act::ProbeResult {
        container: "app".into(),
        container_id: "unknown".into(),
        kind: probes::ProbeKind::Readiness,
        at: Instant::now(),
        outcome: Ok(()),
    };
    let mut pass = Pass::default();
    let quiet = act::Outcome {
        uid: "uid-a".into(),
        probes: vec![probe()],
        ..Default::default()
    };
    assert!(!r.apply(quiet, &mut pass).unwrap(), "nothing to pass for");
    assert_eq!(pass.probes_run, 1);
    let started = act::Outcome {
        uid: "uid-a".into(),
        containers_started: 1,
        ..Default::default()
    };
    assert!(r.apply(started, &mut pass).unwrap());
}

#[tokio::test]
async fn the_desired_pods_are_read_again_only_when_the_cache_or_a_sandbox_changed() {
    let (_d, store, mut r) = setup();
    store
        .apply(Kind::Pod, &[Change::Upsert(pod("a", "img:1"))], None)
        .unwrap();
    let read = |r: &Reconciler<FakeCri>| r.desired.as_ref().map(|c| c.pods.clone()).unwrap();
    r.reconcile().await.unwrap();
    // The first pass started the sandbox, so the second reads the pods for it.
    r.reconcile().await.unwrap();
    let first = read(&r);
    r.reconcile().await.unwrap();
    assert!(
        Arc::ptr_eq(&first, &read(&r)),
        "nothing changed: not read again"
    );

    store
        .apply(Kind::Pod, &[Change::Upsert(pod("b", "img:1"))], None)
        .unwrap();
    r.reconcile().await.unwrap();
    let second = read(&r);
    assert!(!Arc::ptr_eq(&first, &second), "the cache changed");
    assert_eq!(second.len(), 2);

    r.reconcile().await.unwrap();
    let third = read(&r);
    assert!(!Arc::ptr_eq(&second, &third), "b's new sandbox");
    let sb = r
        .cri
        .state
        .lock()
        .unwrap()
        .sandboxes
        .keys()
        .next()
        .cloned()
        .unwrap();
    r.cri.stop_pod_sandbox(&sb).await.unwrap();
    r.reconcile().await.unwrap();
    assert!(!Arc::ptr_eq(&third, &read(&r)), "a sandbox stopped");
}
