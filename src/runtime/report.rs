//! What the runtime reports, and what it owes: pod statuses and Warning Events go to the
//! store's outbox when the store can write, and wait in memory ([`Owed`]) when it cannot (a
//! full disk), so a store that refuses stops none of the pod work.

use super::*;

/// A report the store could not take yet (a full disk), kept until it can.
#[derive(Debug, Clone, Default)]
pub(super) struct Owed {
    /// Warning Events by (pod uid, reason): the latest occurrence, and how many there were.
    pub(super) warnings: BTreeMap<(String, String), OwedWarning>,
    /// The status of a refused pod, by uid (a settled pod's is computed again each pass).
    pub(super) statuses: BTreeMap<String, Value>,
    /// Pods whose adoption aliases are to be forgotten (their objects are gone).
    pub(super) aliases: BTreeSet<String>,
    /// A settled pod's status could not be queued: the next relist is a full pass.
    pub(super) settled: bool,
}

#[derive(Debug, Clone)]
pub(super) struct OwedWarning {
    pub(super) pod: StoredObject,
    pub(super) message: String,
    /// When it last happened (RFC 3339), as the Event says.
    pub(super) at: String,
    pub(super) times: u32,
}

impl Owed {
    pub(super) fn is_empty(&self) -> bool {
        self.warnings.is_empty() && self.statuses.is_empty() && self.aliases.is_empty()
    }

    /// Keeps `times` occurrences of a Warning Event: one per pod and reason, the latest
    /// message and time, the occurrences added up (the Event's count grows by them all).
    pub(super) fn warning(
        &mut self,
        pod: &StoredObject,
        reason: &str,
        message: &str,
        at: String,
        times: u32,
    ) {
        let key = (pod.index.uid.clone(), reason.to_string());
        let w = self.warnings.entry(key).or_insert_with(|| OwedWarning {
            pod: pod.clone(),
            message: String::new(),
            at: String::new(),
            times: 0,
        });
        w.pod = pod.clone();
        w.message = message.to_string();
        w.at = at;
        w.times = w.times.saturating_add(times);
    }
}

impl<R: CriRuntime + 'static> Reconciler<R> {
    /// A pod that cannot run, or cannot start yet: its status says why, and a Warning Event
    /// does too, once per message. Returns whether the status reached the store (else the
    /// next pass tries again, and the Event too).
    pub(super) fn blocked(
        &mut self,
        pod: &DesiredPod,
        reason: &'static str,
        message: &str,
        warn: bool,
    ) -> bool {
        let uid = pod.uid().to_string();
        if warn && self.reported.get(&uid).map(String::as_str) != Some(message) {
            tracing::warn!(pod = %pod.obj.index.name, namespace = %pod.obj.index.namespace, reason,
                %message, "pod cannot run");
            match self.queue_warning(&pod.obj, reason, message, &crate::time::now()) {
                Ok(()) => {
                    self.reported.insert(uid, message.to_string());
                }
                Err(e) => self.report_failed(&e),
            }
        }
        // Not the settled status any more: the next settled one is queued whatever its key.
        self.status_keys.remove(pod.uid());
        match self.queue(
            &pod.obj,
            &pod.status,
            status::blocked_status(reason, message),
        ) {
            Ok(()) => true,
            Err(e) => {
                self.report_failed(&e);
                false
            }
        }
    }

    /// Queues a Warning Event, or keeps it for when the store can take it.
    pub(super) fn warn_event(&mut self, pod: &StoredObject, reason: &str, message: &str) {
        let at = crate::time::now();
        if let Err(e) = self.queue_warning(pod, reason, message, &at) {
            self.report_failed(&e);
            self.owed.warning(pod, reason, message, at, 1);
        }
    }

    /// A report could not be written: logged once until one is again.
    pub(super) fn report_failed(&mut self, e: &RuntimeError) {
        if !self.reports_failing {
            tracing::warn!(error = %e,
                "cannot write reports to the store; the pods carry on, and the reports are kept until it can");
            self.reports_failing = true;
        }
    }

    /// Writes what the store could not take before, as far as it can now.
    pub(super) fn pay_owed(&mut self) {
        if self.owed.is_empty() {
            if self.reports_failing && !self.owed.settled {
                tracing::info!("reports reach the store again");
                self.reports_failing = false;
            }
            return;
        }
        let warnings = std::mem::take(&mut self.owed.warnings);
        for ((_, reason), w) in warnings {
            // Each occurrence counts, as it would have: the Event's count grows by as many.
            let mut left = w.times;
            while left > 0 {
                if let Err(e) = self.queue_warning(&w.pod, &reason, &w.message, &w.at) {
                    self.report_failed(&e);
                    break;
                }
                left -= 1;
            }
            if left > 0 {
                self.owed
                    .warning(&w.pod, &reason, &w.message, w.at.clone(), left);
            }
        }
        for (uid, status) in std::mem::take(&mut self.owed.statuses) {
            // The pod as cached now: gone, nothing is owed.
            let pod = match self.store.get_by_uid(Kind::Pod, &uid) {
                Ok(Some(p)) => p,
                Ok(None) => continue,
                Err(e) => {
                    self.report_failed(&e.into());
                    self.owed.statuses.insert(uid, status);
                    continue;
                }
            };
            if let Err(e) = self.queue_status_of(&pod, status.clone()) {
                self.report_failed(&e);
                self.owed.statuses.insert(uid, status);
            }
        }
        for uid in std::mem::take(&mut self.owed.aliases) {
            if let Err(e) = self.store.forget_aliases_of(&uid) {
                self.report_failed(&e.into());
                self.owed.aliases.insert(uid);
            }
        }
    }

    pub(super) fn queue_status_of(
        &mut self,
        pod: &StoredObject,
        ours: Value,
    ) -> Result<(), RuntimeError> {
        self.status_keys.remove(&pod.index.uid);
        let cached: Value = serde_json::from_str(&pod.raw).unwrap_or(Value::Null);
        let current = cached.get("status").cloned().unwrap_or(Value::Null);
        self.queue(pod, &current, ours)
    }

    pub(super) fn queue_status(
        &mut self,
        pod: &DesiredPod,
        ours: Value,
    ) -> Result<(), RuntimeError> {
        self.queue(&pod.obj, &pod.status, ours)
    }

    /// Queues `ours` for the pod if the apiserver's status (`current`) does not already hold
    /// it; takes a queued one off when it does. Writes nothing when nothing changed.
    pub(super) fn queue(
        &mut self,
        pod: &StoredObject,
        current: &Value,
        ours: Value,
    ) -> Result<(), RuntimeError> {
        let taken = self.store.outbox_taken();
        if self.queued.as_ref().is_none_or(|(t, _)| *t != taken) {
            let mut m = HashMap::new();
            for q in self.store.queued_statuses()? {
                if let Ok(v) = serde_json::from_str(&q.status) {
                    m.insert(q.pod_uid, v);
                }
            }
            self.queued = Some((taken, m));
        }
        let (_, queued) = self.queued.get_or_insert_with(|| (taken, HashMap::new()));
        let uid = &pod.index.uid;
        let ours = status::with_times(&ours, current, queued.get(uid), &crate::time::now());
        if !status::needs_patch(current, &ours) {
            if queued.remove(uid).is_some() {
                self.store.unqueue_status(uid, None)?;
            }
            return Ok(());
        }
        if queued.get(uid) == Some(&ours) {
            return Ok(());
        }
        self.store.queue_status(&QueuedStatus {
            pod_uid: uid.clone(),
            namespace: pod.index.namespace.clone(),
            name: pod.index.name.clone(),
            status: ours.to_string(),
        })?;
        queued.insert(uid.clone(), ours);
        Ok(())
    }

    /// Queues a Warning Event about a pod in the store, for the next time the link is up;
    /// `at` is when it happened.
    pub(super) fn queue_warning(
        &self,
        pod: &StoredObject,
        reason: &str,
        message: &str,
        at: &str,
    ) -> Result<(), RuntimeError> {
        let ev = status::warning_event(pod, reason, message, &self.node_name, at);
        let name = ev["metadata"]["name"].as_str().unwrap_or_default();
        self.store.queue_event(
            &QueuedEvent {
                pod_uid: pod.index.uid.clone(),
                key: format!("{}/{name}", pod.index.namespace),
                namespace: pod.index.namespace.clone(),
                body: ev.to_string(),
                occurrences: 1,
            },
            crate::time::now_ms(),
        )?;
        Ok(())
    }
}
