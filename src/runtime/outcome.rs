//! What a finished pod task did, recorded on the reconciler: counts for the pass, probe
//! verdicts, restart and refusal backoff, the Events and the blocked status a refusal reports.

use super::{act, Pass, Reconciler, RuntimeError};
use crate::cri::CriRuntime;
use crate::object::Kind;
use crate::pod::{status, Holder};
use std::time::Instant;

impl<R: CriRuntime + 'static> Reconciler<R> {
    /// Records a finished task; returns whether a pass should follow: the task changed
    /// something (started, stopped, refused, a probe's verdict), a pass decided without its
    /// pod meanwhile, or a pod waits for its slot.
    pub(super) fn finished(
        &mut self,
        done: Result<(tokio::task::Id, act::Outcome), tokio::task::JoinError>,
        pass: &mut Pass,
    ) -> bool {
        match done {
            Ok((id, o)) => {
                let sat_out = self
                    .task_pods
                    .remove(&id)
                    .is_none_or(|(_, at)| at != self.decided);
                let changed = match self.apply(o, pass) {
                    Ok(changed) => changed,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot record what a pod task did");
                        true
                    }
                };
                changed || sat_out || self.deferred
            }
            Err(e) => {
                if let Some((uid, _)) = self.task_pods.remove(&e.id()) {
                    self.locks.release(&uid, Holder::Runtime);
                    if e.is_panic() {
                        tracing::error!(pod_uid = %uid, error = %e, "a pod task panicked");
                    }
                }
                true
            }
        }
    }

    /// Records what a pod's task did; returns whether that changed anything beyond the
    /// probes' counts (a probe that ran and changed no verdict is the only thing that does
    /// not).
    pub(super) fn apply(&mut self, o: act::Outcome, pass: &mut Pass) -> Result<bool, RuntimeError> {
        let mut changed = o.sandboxes_created > 0
            || o.containers_started > 0
            || o.containers_restarted > 0
            || o.pods_removed > 0
            || o.pods_finalized > 0
            || o.volumes_updated > 0
            || o.volumes_digest.is_some()
            || !o.liveness_kills.is_empty()
            || o.refused.is_some()
            || o.runtime_down.is_some()
            || o.progressed;
        self.locks.release(&o.uid, Holder::Runtime);
        pass.sandboxes_created += o.sandboxes_created;
        pass.containers_started += o.containers_started;
        pass.containers_restarted += o.containers_restarted;
        pass.pods_removed += o.pods_removed;
        pass.pods_finalized += o.pods_finalized;
        pass.volumes_updated += o.volumes_updated;
        pass.probes_run += o.probes.len();
        pass.liveness_kills += o.liveness_kills.len();
        if let Some(d) = o.volumes_digest {
            self.volumes.insert(o.uid.clone(), d);
        }
        for r in o.probes {
            let key = (o.uid.clone(), r.container.clone());
            if let Some(p) = self.probes.get_mut(&key).filter(|p| p.id == r.container_id) {
                let error = r.outcome.as_ref().err().cloned().unwrap_or_default();
                if let Some(v) = p.record(r.kind, r.at, r.outcome) {
                    tracing::info!(pod_uid = %o.uid, container = %r.container, probe = ?r.kind,
                        passing = v, error = %error, "probe verdict changed");
                    changed = true;
                }
            }
        }
        if o.pods_removed > 0 {
            // Its objects are gone: an adoption that bound them to this pod ends too (and
            // the desired pods, read with the aliases, are read again).
            self.desired = None;
            if let Err(e) = self.store.forget_aliases_of(&o.uid) {
                self.report_failed(&e.into());
                self.owed.aliases.insert(o.uid.clone());
            }
        }
        if o.pods_removed > 0 || o.pods_finalized > 0 {
            self.restarts.retain(|(u, _), _| *u != o.uid);
            self.probes.retain(|(u, _), _| *u != o.uid);
            self.volumes.remove(&o.uid);
            self.refused.remove(&o.uid);
            self.reported.remove(&o.uid);
        }
        // Only a kill or a refusal reports about the pod.
        let pod = if o.liveness_kills.is_empty() && o.refused.is_none() {
            None
        } else {
            self.store.get_by_uid(Kind::Pod, &o.uid)?
        };
        for (container, why) in &o.liveness_kills {
            self.probes.remove(&(o.uid.clone(), container.clone()));
            if let Some(pod) = &pod {
                let message =
                    format!("Liveness probe of container {container} failed: {why}; restarting it");
                self.warn_event(pod, "Unhealthy", &message);
            }
        }
        if let Some(e) = o.runtime_down {
            return Err(e.into());
        }
        match (o.refused, &pod) {
            (Some((reason, message)), Some(pod)) => {
                let r = self.refused.entry(o.uid.clone()).or_default();
                r.count += 1;
                r.next_allowed = Some(Instant::now() + self.backoff.delay(r.count));
                if self.reported.get(&o.uid) != Some(&message) {
                    tracing::warn!(pod = %pod.index.name, namespace = %pod.index.namespace, reason,
                        error = %message, "the pod was refused; retrying");
                    self.reported.insert(o.uid.clone(), message.clone());
                }
                // Every refusal counts: the Event's count grows with each retry, as the
                // kubelet's BackOff events do (the crash-loop backoff bounds how often).
                self.warn_event(pod, reason, &message);
                let blocked = status::blocked_status(reason, &message);
                if let Err(e) = self.queue_status_of(pod, blocked.clone()) {
                    self.report_failed(&e);
                    self.owed.statuses.insert(o.uid.clone(), blocked);
                }
                pass.failed.push((pod.index.name.clone(), message));
            }
            (None, _) if o.progressed => {
                self.refused.remove(&o.uid);
                self.reported.remove(&o.uid);
            }
            _ => {}
        }
        Ok(changed)
    }
}
