//! Events: their series counted once across lost answers, expiry and a pod that is gone.

use super::*;

/// Events kept by name, answering as the apiserver does (409 on a second create); the next
/// `lose` writes land and then answer with a timeout, as when the link drops mid-answer.
#[derive(Default)]
struct EventStore {
    events: Mutex<HashMap<String, Value>>,
    lose: Mutex<usize>,
}

fn timeout() -> KubeError {
    KubeError::Timeout {
        request: Request {
            verb: "create",
            resource: "events".into(),
            namespace: None,
            name: None,
        },
        timeout: Duration::from_secs(1),
    }
}

impl EventStore {
    fn answer(&self, v: &Value) -> Result<String, KubeError> {
        let mut lose = self.lose.lock().unwrap();
        if *lose > 0 {
            *lose -= 1;
            return Err(timeout());
        }
        Ok(v.to_string())
    }

    fn count(&self, name: &str) -> i64 {
        self.events.lock().unwrap()[name]["count"].as_i64().unwrap()
    }
}

impl Cloud for Arc<EventStore> {
    async fn patch_pod_status(&self, _: &str, _: &str, _: Vec<u8>) -> Result<String, KubeError> {
        pod_answer()
    }
    async fn create_event(&self, _: &str, b: Vec<u8>) -> Result<String, KubeError> {
        let v: Value = serde_json::from_slice(&b).unwrap();
        let name = v["metadata"]["name"].as_str().unwrap().to_string();
        {
            let mut ev = self.events.lock().unwrap();
            if ev.contains_key(&name) {
                return Err(refused(409, "already exists", None));
            }
            ev.insert(name, v.clone());
        }
        self.answer(&v)
    }
    async fn patch_event(&self, _: &str, name: &str, b: Vec<u8>) -> Result<String, KubeError> {
        let p: Value = serde_json::from_slice(&b).unwrap();
        let v = {
            let mut ev = self.events.lock().unwrap();
            let Some(e) = ev.get_mut(name) else {
                return Err(refused(404, "not found", None));
            };
            e["count"] = p["count"].clone();
            e["lastTimestamp"] = p["lastTimestamp"].clone();
            e["message"] = p["message"].clone();
            e.clone()
        };
        self.answer(&v)
    }
    async fn delete_pod(&self, _: &str, _: &str, _: &str) -> Result<String, KubeError> {
        Ok("{}".into())
    }
    async fn patch_pod(&self, _: &str, _: &str, _: Vec<u8>) -> Result<String, KubeError> {
        Ok("{}".into())
    }
}

#[tokio::test]
async fn an_event_whose_answer_was_lost_is_counted_once() {
    let dir = tempfile::tempdir().unwrap();
    let st = store(&dir);
    pod(&st, "a");
    let cloud = Arc::new(EventStore::default());
    let mut s = Sender::new(cloud.clone(), st.clone());
    s.retry = BackoffPolicy {
        initial: Duration::ZERO,
        max: Duration::ZERO,
    };

    // The create lands, its answer is lost: retried, it finds its own delivery.
    event(&st, "a", "started");
    *cloud.lose.lock().unwrap() = 1;
    s.drain().await.unwrap();
    assert_eq!(st.outbox_counts().unwrap(), (1, 0), "kept for a retry");
    s.drain().await.unwrap();
    assert_eq!(st.outbox_counts().unwrap(), (0, 0));
    assert_eq!(cloud.count("a.edgehub-started"), 1);

    // Once more: the patch of the count lands, its answer is lost.
    event(&st, "a", "started");
    *cloud.lose.lock().unwrap() = 1;
    s.drain().await.unwrap();
    assert_eq!(st.outbox_counts().unwrap(), (1, 0), "kept for a retry");
    s.drain().await.unwrap();
    assert_eq!(st.outbox_counts().unwrap(), (0, 0));
    assert_eq!(
        cloud.count("a.edgehub-started"),
        2,
        "two occurrences, not three"
    );
}

#[tokio::test]
async fn an_occurrence_queued_while_a_lost_create_waits_is_counted_once() {
    let dir = tempfile::tempdir().unwrap();
    let st = store(&dir);
    pod(&st, "a");
    let cloud = Arc::new(EventStore::default());
    let mut s = Sender::new(cloud.clone(), st.clone());
    s.retry = BackoffPolicy {
        initial: Duration::ZERO,
        max: Duration::ZERO,
    };
    // The create lands with count 1, its answer is lost; before the retry the same Event
    // happens again.
    event(&st, "a", "started");
    *cloud.lose.lock().unwrap() = 1;
    s.drain().await.unwrap();
    event(&st, "a", "started");
    s.drain().await.unwrap();
    assert_eq!(st.outbox_counts().unwrap(), (0, 0));
    assert_eq!(
        cloud.count("a.edgehub-started"),
        2,
        "two occurrences: the one that landed is not added again"
    );
}

#[tokio::test]
async fn an_event_the_apiserver_expired_is_created_again_with_the_whole_count() {
    let dir = tempfile::tempdir().unwrap();
    let st = store(&dir);
    pod(&st, "a");
    let cloud = Arc::new(EventStore::default());
    let mut s = Sender::new(cloud.clone(), st.clone());
    event(&st, "a", "started");
    s.drain().await.unwrap();
    assert_eq!(cloud.count("a.edgehub-started"), 1);
    // The apiserver's event TTL passes; the series goes on on the device.
    cloud.events.lock().unwrap().clear();
    event(&st, "a", "started");
    s.drain().await.unwrap();
    assert_eq!(st.outbox_counts().unwrap(), (0, 0));
    assert_eq!(cloud.count("a.edgehub-started"), 2);
}

#[tokio::test]
async fn the_series_of_a_pod_that_is_gone_is_forgotten() {
    let dir = tempfile::tempdir().unwrap();
    let st = store(&dir);
    pod(&st, "a");
    pod(&st, "b");
    let cloud = Arc::new(EventStore::default());
    let mut s = Sender::new(cloud.clone(), st.clone());
    event(&st, "a", "started");
    event(&st, "b", "started");
    s.drain().await.unwrap();
    st.apply(
        Kind::Pod,
        &[Change::Delete {
            namespace: "ns".into(),
            name: "a".into(),
        }],
        None,
    )
    .unwrap();
    // b's next occurrence is delivered; a's series, with nothing left to send, goes.
    event(&st, "b", "started");
    s.drain().await.unwrap();
    let series = |name: &str| {
        st.event_series(&OutboxRow {
            id: 0,
            kind: RowKind::Event,
            pod_uid: format!("uid-{name}"),
            namespace: "ns".into(),
            name: format!("{name}.edgehub-started"),
            dedupe: format!("event/ns/{name}.edgehub-started"),
            body: String::new(),
            occurrences: 1,
            attempts: 0,
            next_attempt_ms: 0,
            last_error: None,
            parked: false,
        })
        .unwrap()
    };
    assert_eq!(series("a"), None);
    assert_eq!(
        series("b"),
        Some(EventSeries {
            count: 2,
            first_timestamp: None,
            created: true
        })
    );
}
