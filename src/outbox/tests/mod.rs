//! The sender's rules against an in-memory apiserver: order per pod, retry, drop, park, the
//! event series, and what a restart keeps.

// The fake answers with the client's own error type, as large as it is.
#![allow(clippy::result_large_err)]

use super::classify::refused;
use super::*;
use crate::kube::Request;
use crate::store::{Change, OpenMode, QueuedEvent, QueuedStatus};
use std::sync::Mutex;

type Answer = Box<dyn Fn(&str) -> Result<String, KubeError> + Send + Sync>;

/// Records each call (`"patch-status ns/name"`, `"create-event ns"`, ...) and answers with
/// `answer`.
struct FakeCloud {
    calls: Mutex<Vec<String>>,
    answer: Answer,
}

impl FakeCloud {
    fn new(answer: impl Fn(&str) -> Result<String, KubeError> + Send + Sync + 'static) -> Self {
        FakeCloud {
            calls: Mutex::new(Vec::new()),
            answer: Box::new(answer),
        }
    }

    fn call(&self, what: String) -> Result<String, KubeError> {
        let r = (self.answer)(&what);
        self.calls.lock().unwrap().push(what);
        r
    }

    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
}

impl Cloud for Arc<FakeCloud> {
    async fn patch_pod_status(
        &self,
        ns: &str,
        name: &str,
        _b: Vec<u8>,
    ) -> Result<String, KubeError> {
        self.call(format!("patch-status {ns}/{name}"))
    }
    async fn create_event(&self, ns: &str, _b: Vec<u8>) -> Result<String, KubeError> {
        self.call(format!("create-event {ns}"))
    }
    async fn patch_event(&self, ns: &str, name: &str, _b: Vec<u8>) -> Result<String, KubeError> {
        self.call(format!("patch-event {ns}/{name}"))
    }
    async fn delete_pod(&self, ns: &str, name: &str, _uid: &str) -> Result<String, KubeError> {
        self.call(format!("delete-pod {ns}/{name}"))
    }
    async fn patch_pod(&self, ns: &str, name: &str, _b: Vec<u8>) -> Result<String, KubeError> {
        self.call(format!("patch-pod {ns}/{name}"))
    }
}

fn store(dir: &tempfile::TempDir) -> Arc<Store> {
    Arc::new(Store::open(&dir.path().join("db"), OpenMode::Normal).unwrap())
}

fn pod(store: &Store, name: &str) {
    let raw = json!({"metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
        "resourceVersion": "1"}, "status": {"phase": "Pending"}});
    store
        .apply(
            Kind::Pod,
            &[Change::Upsert(
                StoredObject::from_raw(Kind::Pod, raw.to_string()).unwrap(),
            )],
            None,
        )
        .unwrap();
}

fn status(store: &Store, name: &str, phase: &str) {
    store
        .queue_status(&QueuedStatus {
            pod_uid: format!("uid-{name}"),
            namespace: "ns".into(),
            name: name.into(),
            status: json!({"phase": phase}).to_string(),
        })
        .unwrap();
}

fn event(store: &Store, name: &str, reason: &str) {
    store
        .queue_event(
            &QueuedEvent {
                pod_uid: format!("uid-{name}"),
                key: format!("ns/{name}.edgehub-{reason}"),
                namespace: "ns".into(),
                body: json!({"metadata": {"name": format!("{name}.edgehub-{reason}")},
                    "message": "m", "lastTimestamp": "t"})
                .to_string(),
                occurrences: 1,
            },
            now_ms(),
        )
        .unwrap();
}

fn pod_answer() -> Result<String, KubeError> {
    Ok(
        json!({"metadata": {"name": "x", "namespace": "ns", "uid": "u", "resourceVersion": "1"}})
            .to_string(),
    )
}

mod delivery;
mod events;
