//! Delivery: what holds a pod back and what does not, dropping, parking, a 401, the rate
//! limit, restarts, and the order of a pod's reports.

use super::*;

#[tokio::test]
async fn a_refused_row_holds_back_its_pod_only_and_a_parked_one_nobody() {
    let dir = tempfile::tempdir().unwrap();
    let st = store(&dir);
    for p in ["a", "b", "c"] {
        pod(&st, p);
    }
    status(&st, "a", "Running");
    event(&st, "a", "started");
    status(&st, "b", "Running");
    event(&st, "b", "started");
    status(&st, "c", "Running");
    let cloud = Arc::new(FakeCloud::new(|what| match what {
        // a: the apiserver is busy; b: refused for good; c: fine.
        "patch-status ns/a" => Err(refused(429, "slow down", Some(60))),
        "patch-status ns/b" => Err(refused(422, "status.phase: Unsupported value", None)),
        "patch-status ns/c" => pod_answer(),
        _ => Ok("{}".into()),
    }));
    let mut s = Sender::new(cloud.clone(), st.clone());
    let d = s.drain().await.unwrap();
    assert_eq!(
        cloud.calls(),
        [
            "patch-status ns/a", // retried later: a's Event waits behind it
            "patch-status ns/b", // parked: b's Event goes on
            "create-event ns",
            "patch-status ns/c",
        ]
    );
    assert_eq!((d.parked, d.statuses_sent, d.events_sent), (1, 1, 1));
    let parked = st.outbox_parked().unwrap();
    assert_eq!(parked.len(), 1);
    assert!(parked[0]
        .last_error
        .as_deref()
        .unwrap()
        .contains("Unsupported value"));
    let rows = st.outbox().unwrap();
    let a = rows
        .iter()
        .find(|r| r.pod_uid == "uid-a" && r.kind == RowKind::Status)
        .unwrap();
    assert!(
        a.next_attempt_ms >= now_ms() + 59_000,
        "Retry-After is honoured"
    );
    assert_eq!(a.attempts, 1);
    assert_eq!(
        st.outbox_counts().unwrap(),
        (2, 1),
        "a's status and Event wait, b's status is parked"
    );
}

#[tokio::test]
async fn gone_targets_are_dropped_and_offline_keeps_everything() {
    let dir = tempfile::tempdir().unwrap();
    let st = store(&dir);
    pod(&st, "a");
    pod(&st, "b");
    status(&st, "a", "Running");
    status(&st, "b", "Running");
    status(&st, "nocache", "Running");
    let cloud = Arc::new(FakeCloud::new(|what| match what {
        "patch-status ns/a" => Err(refused(
            422,
            "Pod \"a\" is invalid: metadata.uid: Invalid value: \"x\": field is immutable",
            None,
        )),
        _ => Err(KubeError::Unreachable {
            request: Request {
                verb: "patch",
                resource: "pods".into(),
                namespace: None,
                name: None,
            },
            server: "s".into(),
            reason: "down".into(),
        }),
    }));
    let mut s = Sender::new(cloud.clone(), st.clone());
    let d = s.drain().await.unwrap();
    assert!(d.offline);
    assert_eq!(d.dropped, 1, "a replacement pod of the same name: dropped");
    // b was not taken (offline); the uncached pod's row was never reached: both kept.
    assert_eq!(st.outbox_counts().unwrap(), (2, 0));
}

#[tokio::test]
async fn statuses_collapse_and_events_count_their_series() {
    let dir = tempfile::tempdir().unwrap();
    let st = store(&dir);
    pod(&st, "a");
    status(&st, "a", "Pending");
    status(&st, "a", "Running");
    event(&st, "a", "backoff");
    event(&st, "a", "backoff");
    assert_eq!(
        st.outbox_counts().unwrap(),
        (2, 0),
        "one status, one Event with 2 occurrences"
    );
    // The apiserver holds an Event of that name the device has no record of: 409, and a
    // PATCH to the series' count, without reading it (a node may not).
    let cloud = Arc::new(FakeCloud::new(|what| match what {
        "create-event ns" => Err(refused(409, "already exists", None)),
        "patch-status ns/a" => pod_answer(),
        _ => Ok("{}".into()),
    }));
    let mut s = Sender::new(cloud.clone(), st.clone());
    s.drain().await.unwrap();
    assert_eq!(
        cloud.calls(),
        [
            "patch-status ns/a",
            "create-event ns",
            "patch-event ns/a.edgehub-backoff",
        ]
    );
    assert_eq!(st.outbox_counts().unwrap(), (0, 0));
    // The series is the device's: the next occurrence is a PATCH alone.
    event(&st, "a", "backoff");
    s.drain().await.unwrap();
    assert_eq!(
        cloud.calls()[3..],
        ["patch-event ns/a.edgehub-backoff"],
        "no create, no read"
    );
}

#[tokio::test]
async fn a_restart_with_a_full_outbox_loses_nothing_and_sends_nothing_twice() {
    let dir = tempfile::tempdir().unwrap();
    {
        let st = store(&dir);
        for i in 0..50 {
            let name = format!("p{i}");
            pod(&st, &name);
            status(&st, &name, "Running");
            event(&st, &name, "started");
        }
        // Half delivered before the power cut.
        let cloud = Arc::new(FakeCloud::new(|what| {
            let n: usize = what
                .trim_start_matches("patch-status ns/p")
                .parse()
                .unwrap_or(0);
            if what.starts_with("patch-status") && n >= 25 {
                Err(KubeError::Timeout {
                    request: Request {
                        verb: "patch",
                        resource: "pods".into(),
                        namespace: None,
                        name: None,
                    },
                    timeout: Duration::from_secs(1),
                })
            } else if what.starts_with("patch-status") {
                pod_answer()
            } else {
                Ok("{}".into())
            }
        }));
        let mut s = Sender::new(cloud.clone(), st.clone());
        s.drain().await.unwrap();
        assert_eq!(
            st.outbox_counts().unwrap().0,
            50,
            "p25..p49: status and Event each"
        );
    }
    // The store is opened again, as after a restart.
    let st = store(&dir);
    assert_eq!(st.outbox_counts().unwrap(), (50, 0), "nothing lost");
    let cloud = Arc::new(FakeCloud::new(|what| {
        if what.starts_with("patch-status") {
            pod_answer()
        } else {
            Ok("{}".into())
        }
    }));
    let mut s = Sender::new(cloud.clone(), st.clone());
    let d = s.drain().await.unwrap();
    assert_eq!(
        (d.statuses_sent, d.events_sent),
        (25, 25),
        "nothing sent twice"
    );
    assert!(cloud
        .calls()
        .iter()
        .all(|c| !c.starts_with("patch-status ns/p1 ") && c != "patch-status ns/p0"));
    assert_eq!(st.outbox_counts().unwrap(), (0, 0));
}

#[tokio::test]
async fn the_rate_limit_spaces_requests() {
    let dir = tempfile::tempdir().unwrap();
    let st = store(&dir);
    for i in 0..5 {
        let name = format!("p{i}");
        pod(&st, &name);
        status(&st, &name, "Running");
    }
    let cloud = Arc::new(FakeCloud::new(|_| pod_answer()));
    let mut s = Sender::new(cloud.clone(), st.clone());
    s.max_rate = 50;
    let t = Instant::now();
    let d = s.drain().await.unwrap();
    assert_eq!(d.requests, 5);
    // Four gaps of 20 ms at least; a behaviour of the limiter, not a performance claim.
    assert!(
        t.elapsed() >= Duration::from_millis(80),
        "{:?}",
        t.elapsed()
    );
}

fn no_wait(s: &mut Sender<Arc<FakeCloud>>) {
    s.retry = BackoffPolicy {
        initial: Duration::ZERO,
        max: Duration::ZERO,
    };
}

#[tokio::test]
async fn a_401_stops_the_drain_and_keeps_every_row_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let st = store(&dir);
    for p in ["a", "b"] {
        pod(&st, p);
        status(&st, p, "Running");
        event(&st, p, "started");
    }
    let revoked = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let r = revoked.clone();
    let cloud = Arc::new(FakeCloud::new(move |what| {
        if r.load(std::sync::atomic::Ordering::SeqCst) {
            Err(refused(401, "Unauthorized", None))
        } else if what.starts_with("patch-status") {
            pod_answer()
        } else {
            Ok("{}".into())
        }
    }));
    let mut s = Sender::new(cloud.clone(), st.clone());
    no_wait(&mut s);
    let d = s.drain().await.unwrap();
    assert!(d.unauthorized);
    assert_eq!(cloud.calls().len(), 1, "one refusal says it for every row");
    assert_eq!(st.outbox_counts().unwrap(), (4, 0), "nothing parked");
    assert!(st.outbox().unwrap().iter().all(|r| r.attempts == 0));
    // Credentials work again: everything goes.
    revoked.store(false, std::sync::atomic::Ordering::SeqCst);
    let d = s.drain().await.unwrap();
    assert!(!d.unauthorized);
    assert_eq!((d.statuses_sent, d.events_sent), (2, 2));
    assert_eq!(st.outbox_counts().unwrap(), (0, 0));
}

#[tokio::test]
async fn a_parked_row_is_tried_again_when_due_without_holding_its_pod() {
    let dir = tempfile::tempdir().unwrap();
    let st = store(&dir);
    pod(&st, "a");
    event(&st, "a", "started");
    status(&st, "a", "Running");
    let refusals = Arc::new(std::sync::atomic::AtomicUsize::new(1));
    let left = refusals.clone();
    let cloud = Arc::new(FakeCloud::new(move |what| match what {
        "create-event ns" if left.load(std::sync::atomic::Ordering::SeqCst) > 0 => {
            left.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            Err(refused(400, "bad", None))
        }
        "patch-status ns/a" => pod_answer(),
        _ => Ok("{}".into()),
    }));
    let mut s = Sender::new(cloud.clone(), st.clone());
    s.drain().await.unwrap();
    assert_eq!(
        st.outbox_counts().unwrap(),
        (0, 1),
        "parked; the status went"
    );
    let parked = &st.outbox_parked().unwrap()[0];
    // The first wait is the retry ceiling, jittered into its upper half.
    let wait = parked.next_attempt_ms - now_ms();
    assert!((140_000..=300_000).contains(&wait), "{wait}");
    let due = s.next_due().unwrap().as_millis() as i64;
    assert!(
        (wait - 1_000..=wait).contains(&due),
        "the sender wakes for it: {due} ms, row due in {wait} ms"
    );
    // Due now: tried again, and this time taken.
    no_wait(&mut s);
    st.outbox_retry(parked.id, 0, "x").unwrap();
    s.drain().await.unwrap();
    assert_eq!(st.outbox_counts().unwrap(), (0, 0));
    assert_eq!(
        cloud.calls(),
        ["create-event ns", "patch-status ns/a", "create-event ns"]
    );
}

#[tokio::test]
async fn no_relationship_is_retried_a_few_times_then_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let st = store(&dir);
    pod(&st, "a");
    status(&st, "a", "Running");
    let cloud = Arc::new(FakeCloud::new(|_| {
        Err(refused(
            403,
            "pods \"a\" is forbidden: User \"system:node:n\" cannot patch resource \"pods/status\": no relationship found between node 'n' and this object",
            None,
        ))
    }));
    let mut s = Sender::new(cloud.clone(), st.clone());
    no_wait(&mut s);
    for _ in 0..classify::AUTHORIZER_LAG_RETRIES {
        s.drain().await.unwrap();
        assert_eq!(st.outbox_counts().unwrap(), (1, 0), "retried");
    }
    let d = s.drain().await.unwrap();
    assert_eq!(d.dropped, 1);
    assert_eq!(st.outbox_counts().unwrap(), (0, 0));
}

#[tokio::test]
async fn a_status_queued_again_goes_after_the_events_queued_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let st = store(&dir);
    pod(&st, "a");
    // The pod's status, then an upgrade starts, then its status changes.
    status(&st, "a", "Pending");
    event(&st, "a", "started");
    status(&st, "a", "Running");
    let cloud = Arc::new(FakeCloud::new(|what| match what {
        "patch-status ns/a" => pod_answer(),
        _ => Ok("{}".into()),
    }));
    let mut s = Sender::new(cloud.clone(), st.clone());
    s.drain().await.unwrap();
    assert_eq!(
        cloud.calls(),
        ["create-event ns", "patch-status ns/a"],
        "in the order it happened"
    );
}

#[tokio::test]
async fn a_status_of_a_pod_a_reset_cache_has_not_listed_yet_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let st = store(&dir);
    status(&st, "nocache", "Running");
    let cloud = Arc::new(FakeCloud::new(|_| pod_answer()));
    let mut s = Sender::new(cloud.clone(), st.clone());
    let d = s.drain().await.unwrap();
    assert_eq!(d.dropped, 0, "no pod list yet: not a verdict");
    assert_eq!(st.outbox_counts().unwrap(), (1, 0));
    // Once the pod list has completed without it, the pod is gone.
    st.set_cursor("pods?fieldSelector=spec.nodeName=edge-1", "5")
        .unwrap();
    st.checkpoint_cursors(Duration::ZERO, true).unwrap();
    for r in st.outbox().unwrap() {
        st.outbox_retry(r.id, 0, "due").unwrap();
    }
    let d = s.drain().await.unwrap();
    assert_eq!(d.dropped, 1);
    assert_eq!(st.outbox_counts().unwrap(), (0, 0));
}
