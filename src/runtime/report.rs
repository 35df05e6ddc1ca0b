//! Delivers what the runtime queued for the apiserver (pod statuses and Warning Events) in
//! its own task, so a dead or blackholed link never holds up a pod, and a refused report never
//! holds up the ones behind it. (The report issue replaces this with the outbox.)
//!
//! - A status is sent as the two-way patch from the status the apiserver holds (the cached
//!   pod) to the queued one merged onto it; the answer is written back into the cache, so the
//!   next comparison is against what the apiserver now holds.
//! - An Event is created; if it exists already (409), its count and lastTimestamp are patched,
//!   the kubelet's event series.
//! - The revision a pod runs after an offline upgrade is reported by delete-and-adopt: once
//!   its DaemonSet's update revision is still that revision, the pod object is deleted (uid
//!   precondition, grace 0); the DaemonSet controller creates its replacement at that
//!   revision, and the runtime binds the replacement to the running sandbox. A node identity
//!   may delete its pods but not patch their spec or labels. With `report.mode = "patch"`
//!   (identities that may), the images and the hash label are patched instead.

use super::status::{merge_onto, two_way_patch};
use crate::backoff::Backoff;
use crate::kube::resource::{EVENTS, PODS};
use crate::kube::{ApiClient, KubeError, PatchType};
use crate::object::Kind;
use crate::store::{QueuedEvent, QueuedStatus, Store, StoreError, StoredObject};
use crate::sync::LinkState;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How the revision an upgrade committed offline reaches the cloud.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RevisionReport {
    /// Delete the pod object; its replacement adopts the running sandbox (a node identity).
    #[default]
    DeleteAndAdopt,
    /// Patch the pod's images and hash label (identities allowed to patch pods).
    Patch,
}

/// What one drain did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Drained {
    pub statuses_sent: usize,
    pub events_sent: usize,
    /// Revisions reported (pods deleted for adoption, or patched).
    pub revisions_reported: usize,
    /// Dropped: the pod is gone, or the apiserver will never take it.
    pub dropped: usize,
    /// The link is down; the rest waits.
    pub offline: bool,
}

pub struct Reporter {
    client: ApiClient,
    store: Arc<Store>,
    /// Reports the apiserver refused, by queue key: retried after a backoff, while the ones
    /// behind them go on.
    retry: HashMap<String, (Instant, Backoff)>,
    /// Waits after the link was found down.
    offline: Backoff,
    pub revision_report: RevisionReport,
}

enum Sent {
    Done,
    Drop(String),
    Offline,
    Retry(KubeError),
}

impl Reporter {
    pub fn new(client: ApiClient, store: Arc<Store>) -> Reporter {
        Reporter {
            client,
            store,
            retry: HashMap::new(),
            offline: Backoff::new(Duration::from_secs(1), Duration::from_secs(30)),
            revision_report: RevisionReport::default(),
        }
    }

    /// Drains on every queued report, when the link comes back, and after a backoff while
    /// something is left, until shutdown.
    pub async fn run(
        mut self,
        mut link: Option<watch::Receiver<LinkState>>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut queued = self.store.subscribe_reports();
        let mut wait = Duration::ZERO;
        loop {
            let link_up = async {
                match link.as_mut() {
                    Some(l) => {
                        if l.changed().await.is_err() {
                            std::future::pending::<()>().await
                        }
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                r = queued.changed() => { if r.is_err() { return; } }
                _ = link_up => {}
                _ = shutdown.changed() => return,
            }
            wait = match self.drain().await {
                Ok(d) if d.offline => self.offline.next_delay(),
                Ok(_) => {
                    self.offline.reset();
                    self.next_retry().unwrap_or(Duration::from_secs(3600))
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the report queues");
                    Duration::from_secs(10)
                }
            };
        }
    }

    fn next_retry(&self) -> Option<Duration> {
        let now = Instant::now();
        self.retry
            .values()
            .map(|(t, _)| t.saturating_duration_since(now))
            .min()
    }

    fn due(&self, key: &str) -> bool {
        self.retry
            .get(key)
            .is_none_or(|(t, _)| Instant::now() >= *t)
    }

    fn failed(&mut self, key: &str, e: &KubeError) {
        let entry = self.retry.entry(key.to_string()).or_insert_with(|| {
            (
                Instant::now(),
                Backoff::new(Duration::from_secs(1), Duration::from_secs(300)),
            )
        });
        let first = entry.1.failures() == 0;
        let wait = crate::sync::delay_after(e, &mut entry.1).max(Duration::from_millis(200));
        entry.0 = Instant::now() + wait;
        if first {
            tracing::warn!(report = %key, error = %e, "the apiserver refused a report; retrying with backoff");
        }
    }

    /// Sends what is queued and due; stops at the first sign the link is down.
    pub async fn drain(&mut self) -> Result<Drained, StoreError> {
        let mut d = Drained::default();
        for q in self.store.queued_statuses()? {
            let key = format!("status/{}", q.pod_uid);
            if !self.due(&key) {
                continue;
            }
            match self.send_status(&q).await? {
                Sent::Done => {
                    self.retry.remove(&key);
                    d.statuses_sent += 1;
                }
                Sent::Drop(why) => {
                    tracing::info!(pod = %q.name, namespace = %q.namespace, reason = %why, "queued status dropped");
                    self.store.unqueue_status(&q.pod_uid, Some(&q.status))?;
                    self.retry.remove(&key);
                    d.dropped += 1;
                }
                Sent::Offline => {
                    d.offline = true;
                    return Ok(d);
                }
                Sent::Retry(e) => self.failed(&key, &e),
            }
        }
        for ev in self.store.queued_events()? {
            let key = format!("event/{}", ev.key);
            if !self.due(&key) {
                continue;
            }
            match self.send_event(&ev).await {
                Sent::Done => {
                    self.store.event_sent(&ev.key, ev.occurrences)?;
                    self.retry.remove(&key);
                    d.events_sent += 1;
                }
                Sent::Drop(why) => {
                    tracing::warn!(event = %ev.key, reason = %why, "Event refused; dropped");
                    self.store.event_sent(&ev.key, ev.occurrences)?;
                    self.retry.remove(&key);
                    d.dropped += 1;
                }
                Sent::Offline => {
                    d.offline = true;
                    return Ok(d);
                }
                Sent::Retry(e) => self.failed(&key, &e),
            }
        }
        for r in self.store.running_revisions()? {
            if r.awaiting_since_ms.is_some() {
                continue;
            }
            let key = format!("revision/{}", r.pod_uid);
            if !self.due(&key) {
                continue;
            }
            match self.send_revision(&r).await? {
                Sent::Done => {
                    self.retry.remove(&key);
                    d.revisions_reported += 1;
                }
                Sent::Drop(why) => {
                    tracing::debug!(pod_uid = %r.pod_uid, reason = %why, "revision not reported");
                    self.retry.remove(&key);
                }
                Sent::Offline => {
                    d.offline = true;
                    return Ok(d);
                }
                Sent::Retry(e) => self.failed(&key, &e),
            }
        }
        Ok(d)
    }

    /// Reports the revision a pod runs after an offline upgrade, when its DaemonSet still
    /// wants that revision (if it moved on, the pod's status says what runs and
    /// PodNeedUpgrade stays True).
    async fn send_revision(&self, r: &crate::store::RunningRevision) -> Result<Sent, StoreError> {
        let Some(pod) = self.store.get_by_uid(Kind::Pod, &r.pod_uid)? else {
            return Ok(Sent::Drop("the pod is no longer cached".into()));
        };
        if pod.index.revision_hash.as_deref() == Some(r.hash.as_str()) {
            return Ok(Sent::Drop("the cloud already has the revision".into()));
        }
        let Some(owner) = pod.index.owner_uid.as_deref() else {
            return Ok(Sent::Drop("the pod has no owner".into()));
        };
        let mut decider = crate::need_upgrade::Decider::new(&self.store);
        let wanted = decider
            .daemonset(owner)?
            .and_then(|ds| crate::revision::update_revision(&ds.revisions))
            .map(|rev| rev.hash.clone());
        if wanted.as_deref() != Some(r.hash.as_str()) {
            return Ok(Sent::Drop(
                "the DaemonSet moved on: status only, PodNeedUpgrade stays True".into(),
            ));
        }
        let ns = &pod.index.namespace;
        let name = &pod.index.name;
        let patchable = matches!(
            serde_json::from_str::<crate::upgrade::plan::RunningAs>(&r.images),
            Ok(crate::upgrade::plan::RunningAs::Images(_))
        );
        if self.revision_report == RevisionReport::Patch && patchable {
            let images = match serde_json::from_str(&r.images) {
                Ok(crate::upgrade::plan::RunningAs::Images(i)) => i,
                _ => Default::default(),
            };
            let containers: Vec<Value> = images
                .iter()
                .map(|(n, i)| json!({"name": n, "image": i}))
                .collect();
            let patch = json!({
                "metadata": {"uid": r.pod_uid, "labels": {crate::object::REVISION_HASH_LABEL: r.hash}},
                "spec": {"containers": containers},
            });
            return Ok(
                match self
                    .client
                    .patch(
                        &PODS,
                        Some(ns),
                        name,
                        None,
                        PatchType::StrategicMerge,
                        patch.to_string().into_bytes(),
                    )
                    .await
                {
                    Ok(_) => {
                        tracing::info!(pod = %name, namespace = %ns, revision = %r.hash, "revision reported by patch");
                        Sent::Done
                    }
                    Err(e) => classify(e),
                },
            );
        }
        let answer = self
            .client
            .delete(&PODS, Some(ns), name, Some(&r.pod_uid), Some(0))
            .await;
        match answer {
            // 404: already gone; 409: replaced under another uid. Either way it awaits its
            // replacement.
            Ok(_) => {}
            Err(e) if matches!(e.code(), Some(404) | Some(409)) => {}
            Err(e) => return Ok(classify(e)),
        }
        tracing::info!(pod = %name, namespace = %ns, revision = %r.hash,
            "pod object deleted; its replacement will adopt the running sandbox");
        self.store.mark_awaiting_adoption(&r.pod_uid)?;
        Ok(Sent::Done)
    }

    async fn send_status(&self, q: &QueuedStatus) -> Result<Sent, StoreError> {
        let Some(pod) = self.store.get_by_uid(Kind::Pod, &q.pod_uid)? else {
            return Ok(Sent::Drop("the pod is no longer cached".into()));
        };
        let ours: Value = match serde_json::from_str(&q.status) {
            Ok(v) => v,
            Err(e) => return Ok(Sent::Drop(format!("unreadable queued status: {e}"))),
        };
        let cached: Value = serde_json::from_str(&pod.raw).unwrap_or(Value::Null);
        let current = cached.get("status").cloned().unwrap_or_else(|| json!({}));
        let Some(patch) = two_way_patch(&q.pod_uid, &current, &merge_onto(&current, &ours)) else {
            // The apiserver already holds it.
            self.store.unqueue_status(&q.pod_uid, Some(&q.status))?;
            return Ok(Sent::Done);
        };
        let answer = self
            .client
            .patch(
                &PODS,
                Some(&pod.index.namespace),
                &pod.index.name,
                Some("status"),
                PatchType::StrategicMerge,
                patch.to_string().into_bytes(),
            )
            .await;
        match answer {
            Ok(raw) => {
                match StoredObject::from_raw(Kind::Pod, raw) {
                    Ok(obj) => {
                        self.store.put_if_newer(&obj)?;
                    }
                    Err(e) => {
                        tracing::debug!(pod = %q.name, error = %e, "status patch answer not stored")
                    }
                }
                self.store.unqueue_status(&q.pod_uid, Some(&q.status))?;
                tracing::debug!(pod = %q.name, namespace = %q.namespace, "pod status reported");
                Ok(Sent::Done)
            }
            Err(e) => Ok(classify(e)),
        }
    }

    async fn send_event(&self, ev: &QueuedEvent) -> Sent {
        let mut body: Value = match serde_json::from_str(&ev.body) {
            Ok(v) => v,
            Err(e) => return Sent::Drop(format!("unreadable queued Event: {e}")),
        };
        body["count"] = ev.occurrences.into();
        match self
            .client
            .create(&EVENTS, Some(&ev.namespace), body.to_string().into_bytes())
            .await
        {
            Ok(_) => Sent::Done,
            Err(e) if e.code() == Some(409) => self.bump_event(&body, ev).await,
            Err(e) => classify(e),
        }
    }

    /// The Event exists: add this occurrence to its count, as the kubelet's series does.
    async fn bump_event(&self, body: &Value, ev: &QueuedEvent) -> Sent {
        let name = body
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let existing = match self.client.get(&EVENTS, Some(&ev.namespace), name).await {
            Ok(raw) => serde_json::from_str::<Value>(&raw).unwrap_or(Value::Null),
            Err(e) => return classify(e),
        };
        let count = existing["count"].as_i64().unwrap_or(1) + ev.occurrences;
        let patch = json!({
            "count": count,
            "lastTimestamp": body["lastTimestamp"],
            "message": body["message"],
        });
        match self
            .client
            .patch(
                &EVENTS,
                Some(&ev.namespace),
                name,
                None,
                PatchType::StrategicMerge,
                patch.to_string().into_bytes(),
            )
            .await
        {
            Ok(_) => Sent::Done,
            Err(e) => classify(e),
        }
    }
}

/// What a failed report means.
fn classify(e: KubeError) -> Sent {
    if e.is_offline() {
        return Sent::Offline;
    }
    match e.code() {
        // The pod is gone (the Node authorizer answers 403 for pods not bound here), or was
        // replaced by another of the same name.
        Some(404) | Some(403) => Sent::Drop(e.to_string()),
        Some(422) if e.is_stale_uid() => Sent::Drop(e.to_string()),
        Some(400) => Sent::Drop(e.to_string()),
        _ => Sent::Retry(e),
    }
}
