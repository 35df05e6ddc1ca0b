//! The pod runtime: edgehub is the node agent, so it runs the node's pods itself. A reconciler
//! compares the desired pods (the cache: pods bound to this node) with the actual ones (CRI
//! sandboxes and containers carrying edgehub's label) and closes the gap:
//!
//! - missing sandboxes and containers are created (init containers first, in order);
//! - exited containers are restarted per restartPolicy, with the kubelet's crash-loop backoff;
//! - what is no longer desired is stopped and removed;
//! - a pod deleted in the cloud (deletionTimestamp set) is stopped within its grace period,
//!   then its deletion is finished on the apiserver (DELETE, grace 0, uid precondition).
//!
//! It never touches CRI objects without edgehub's `managed-by` label. It runs on every cache
//! change and periodically, from the cache alone: pods come back after a reboot without a link.

use crate::cri::{api, labels, CriError, CriRuntime};
use crate::kube::resource::PODS;
use crate::kube::ApiClient;
use crate::object::Kind;
use crate::podspec::{
    self, Missing, PlanError, PodContext, PodPlan, PullPolicy, RestartPolicy, Unsupported,
};
use crate::probe::{self, ProbeSpec, ProbeState};
use crate::sources::fetch;
use crate::store::{QueuedEvent, Store, StoredObject};
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Cri(#[from] CriError),
    #[error("cache: {0}")]
    Store(#[from] crate::store::StoreError),
}

/// Crash-loop backoff, as the kubelet does it: 10 s doubling to 5 min.
#[derive(Debug, Clone, Copy)]
pub struct BackoffPolicy {
    pub initial: Duration,
    pub max: Duration,
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        BackoffPolicy {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(300),
        }
    }
}

impl BackoffPolicy {
    /// The wait before restart number `restarts` (1 for the first restart).
    pub fn delay(&self, restarts: u32) -> Duration {
        let factor = 1u32
            .checked_shl(restarts.saturating_sub(1).min(16))
            .unwrap_or(u32::MAX);
        self.initial.saturating_mul(factor).min(self.max)
    }
}

/// What one pass did, for logs and tests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pass {
    pub sandboxes_created: usize,
    pub containers_started: usize,
    pub containers_restarted: usize,
    pub pods_removed: usize,
    pub pods_finalized: usize,
    /// Pod status patches delivered to the apiserver.
    pub statuses_sent: usize,
    /// Warning Events delivered to the apiserver.
    pub events_sent: usize,
    /// File volumes rewritten (a renewed token, an edited ConfigMap).
    pub volumes_updated: usize,
    /// Pods waiting for a ConfigMap, Secret or token edgehub does not have.
    pub missing: Vec<(String, Missing)>,
    /// Pods the runtime or the host refused (image pull, container creation, volumes), and
    /// why.
    pub failed: Vec<(String, String)>,
    /// Liveness and readiness probes run.
    pub probes_run: usize,
    /// Containers stopped because their liveness probe failed.
    pub liveness_kills: usize,
    /// Pods that cannot run, and why.
    pub unsupported: Vec<(String, Unsupported)>,
}

/// Per-container restart bookkeeping.
#[derive(Debug, Default, Clone)]
struct Restarts {
    count: u32,
    next_allowed: Option<Instant>,
}

pub struct Reconciler<R: CriRuntime> {
    pub cri: R,
    pub store: Arc<Store>,
    /// Finishes deletions on the apiserver; `None` runs without one.
    pub client: Option<ApiClient>,
    pub data_dir: PathBuf,
    pub node_name: String,
    pub host_ip: Option<String>,
    pub backoff: BackoffPolicy,
    restarts: HashMap<(String, String), Restarts>,
    /// What was last reported per pod uid (a Warning Event each time it changes).
    reported: HashMap<String, String>,
    /// Probe history per (pod uid, container name).
    probes: HashMap<(String, String), ContainerProbes>,
    /// Pods the runtime refused, by uid: retried after the same backoff as crash loops
    /// (the kubelet's ImagePullBackOff), not on every pass.
    refused: HashMap<String, Restarts>,
}

/// The probes of one running container; replaced when the container is.
struct ContainerProbes {
    id: String,
    liveness: Option<ProbeState>,
    readiness: Option<ProbeState>,
    liveness_spec: Option<ProbeSpec>,
    readiness_spec: Option<ProbeSpec>,
}

impl ContainerProbes {
    fn next_due(&self) -> Option<Instant> {
        let due = |st: &Option<ProbeState>, sp: &Option<ProbeSpec>| match (st, sp) {
            (Some(st), Some(sp)) => Some(st.due_at(sp)),
            _ => None,
        };
        [
            due(&self.liveness, &self.liveness_spec),
            due(&self.readiness, &self.readiness_spec),
        ]
        .into_iter()
        .flatten()
        .min()
    }
}

/// The label selector of this node's edgehub objects.
fn managed(node: &str) -> HashMap<String, String> {
    HashMap::from([
        (labels::MANAGED_BY.to_string(), "edgehub".to_string()),
        (labels::NODE.to_string(), node.to_string()),
    ])
}

/// Checked again on what the runtime returns: a runtime that ignored the selector must not
/// make edgehub remove someone else's containers.
fn is_managed(l: &HashMap<String, String>, node: &str) -> bool {
    l.get(labels::MANAGED_BY).map(String::as_str) == Some("edgehub")
        && l.get(labels::NODE).map(String::as_str) == Some(node)
}

impl<R: CriRuntime> Reconciler<R> {
    pub fn new(
        cri: R,
        store: Arc<Store>,
        client: Option<ApiClient>,
        data_dir: PathBuf,
        node_name: String,
    ) -> Self {
        Reconciler {
            cri,
            store,
            client,
            data_dir,
            node_name,
            host_ip: None,
            backoff: BackoffPolicy::default(),
            restarts: HashMap::new(),
            reported: HashMap::new(),
            probes: HashMap::new(),
            refused: HashMap::new(),
        }
    }

    /// Reconciles on every cache change and every `period`, until shutdown. Errors (a dead CRI
    /// socket, say) are logged and retried on the next round.
    pub async fn run(mut self, period: Duration, mut shutdown: watch::Receiver<bool>) {
        let mut changes = self.store.subscribe();
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            let probe_at = probe_wake(self.next_probe_at(), Instant::now());
            let probe_due = async move {
                match probe_at {
                    Some(t) => tokio::time::sleep_until(t.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tick.tick() => {}
                _ = probe_due => {}
                r = changes.changed() => { if r.is_err() { return; } }
                _ = shutdown.changed() => return,
            }
            match self.reconcile().await {
                Ok(p) => {
                    if failing {
                        tracing::info!("pod runtime reconciling again");
                        failing = false;
                    }
                    if p != Pass::default() {
                        tracing::debug!(pass = ?p, "reconciled");
                    }
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, "pod runtime cannot reconcile; retrying");
                    }
                    failing = true;
                    // What the probes knew is stale once the runtime failed; they start over.
                    self.probes.clear();
                }
            }
        }
    }

    /// A pod the runtime or the host refused: it says why (status and Event, once per
    /// message), the other pods carry on, and it is retried after the crash-loop backoff
    /// (the kubelet's ImagePullBackOff) rather than on every pass.
    fn pod_failed(
        &mut self,
        pod: &StoredObject,
        raw: &Value,
        reason: &'static str,
        message: String,
        pass: &mut Pass,
    ) -> Result<(), RuntimeError> {
        let r = self.refused.entry(pod.index.uid.clone()).or_default();
        r.count += 1;
        r.next_allowed = Some(Instant::now() + self.backoff.delay(r.count));
        if self.reported.get(&pod.index.uid) != Some(&message) {
            tracing::warn!(pod = %pod.index.name, namespace = %pod.index.namespace, reason, error = %message, "the pod was refused; retrying");
            self.queue_warning(pod, reason, &message)?;
            self.reported.insert(pod.index.uid.clone(), message.clone());
        }
        self.queue_status(pod, raw, blocked_status(reason, &message))?;
        pass.failed.push((pod.index.name.clone(), message));
        Ok(())
    }

    /// Queues a Warning Event about a pod in the store, for the next time the link is up.
    fn queue_warning(
        &self,
        pod: &StoredObject,
        reason: &str,
        message: &str,
    ) -> Result<(), RuntimeError> {
        let ev = warning_event(pod, reason, message, &self.node_name, &crate::time::now());
        let name = ev["metadata"]["name"].as_str().unwrap_or_default();
        self.store.queue_event(
            &QueuedEvent {
                key: format!("{}/{name}", pod.index.namespace),
                namespace: pod.index.namespace.clone(),
                body: ev.to_string(),
            },
            crate::time::now_ms(),
        )?;
        Ok(())
    }

    /// When the next probe is due, so the loop wakes for it.
    fn next_probe_at(&self) -> Option<Instant> {
        self.probes
            .values()
            .filter_map(ContainerProbes::next_due)
            .min()
    }

    /// Runs the pod's due probes. A readiness verdict shows in the next status; a liveness
    /// failure stops the container, which is then restarted per restartPolicy (with the
    /// crash-loop backoff), as the kubelet does.
    async fn probe_pod(
        &mut self,
        pod: &StoredObject,
        plan: &PodPlan,
        containers: &[api::Container],
        pass: &mut Pass,
    ) -> Result<(), RuntimeError> {
        let mine: Vec<&api::Container> = containers
            .iter()
            .filter(|c| c.labels.get(labels::POD_UID) == Some(&plan.uid))
            .collect();
        let ip = plan.pod_ip.clone().unwrap_or_else(|| "127.0.0.1".into());
        for cp in &plan.containers {
            let key = (plan.uid.clone(), cp.name.clone());
            if cp.liveness.is_none() && cp.readiness.is_none() {
                continue;
            }
            let Some(c) = latest(&mine, &cp.name)
                .filter(|c| c.state == api::ContainerState::ContainerRunning as i32)
            else {
                self.probes.remove(&key);
                continue;
            };
            let now = Instant::now();
            let entry = self
                .probes
                .entry(key.clone())
                .or_insert_with(|| ContainerProbes {
                    id: String::new(),
                    liveness: None,
                    readiness: None,
                    liveness_spec: None,
                    readiness_spec: None,
                });
            if entry.id != c.id {
                *entry = ContainerProbes {
                    id: c.id.clone(),
                    liveness: cp.liveness.as_ref().map(|_| ProbeState::new(now)),
                    readiness: cp.readiness.as_ref().map(|_| ProbeState::new(now)),
                    liveness_spec: cp.liveness.clone(),
                    readiness_spec: cp.readiness.clone(),
                };
            }
            if let (Some(st), Some(sp)) = (entry.readiness.as_mut(), cp.readiness.as_ref()) {
                if st.due_at(sp) <= now {
                    let outcome = probe::run(&self.cri, &c.id, &ip, sp).await;
                    pass.probes_run += 1;
                    if let Some(v) = st.record(Instant::now(), outcome, sp) {
                        tracing::info!(pod = %plan.name, container = %cp.name, ready = v,
                            error = st.last_error.as_deref().unwrap_or(""), "readiness changed");
                    }
                }
            }
            let mut kill = None;
            if let (Some(st), Some(sp)) = (entry.liveness.as_mut(), cp.liveness.as_ref()) {
                if st.due_at(sp) <= now {
                    let outcome = probe::run(&self.cri, &c.id, &ip, sp).await;
                    pass.probes_run += 1;
                    if st.record(Instant::now(), outcome, sp) == Some(false) {
                        kill = Some(st.last_error.clone().unwrap_or_default());
                    }
                }
            }
            if let Some(why) = kill {
                let message = format!(
                    "Liveness probe of container {} failed: {why}; restarting it",
                    cp.name
                );
                tracing::warn!(pod = %plan.name, container = %cp.name, error = %why, "liveness probe failed; stopping the container");
                self.probes.remove(&key);
                self.ignore_missing(self.cri.stop_container(&c.id, plan.grace_period_secs).await)?;
                pass.liveness_kills += 1;
                self.queue_warning(pod, "Unhealthy", &message)?;
            }
        }
        Ok(())
    }

    fn pod_dir(&self, uid: &str) -> PathBuf {
        self.data_dir.join("pods").join(uid)
    }

    /// One pass over all pods.
    pub async fn reconcile(&mut self) -> Result<Pass, RuntimeError> {
        let mut pass = Pass::default();
        let pods = self.store.list(Kind::Pod)?;
        let sandboxes: Vec<api::PodSandbox> = self
            .cri
            .list_pod_sandbox(managed(&self.node_name))
            .await?
            .into_iter()
            .filter(|s| is_managed(&s.labels, &self.node_name))
            .collect();
        let containers: Vec<api::Container> = self
            .cri
            .list_containers(managed(&self.node_name))
            .await?
            .into_iter()
            .filter(|c| is_managed(&c.labels, &self.node_name))
            .collect();

        // Every pod not being deleted is wanted, even one whose JSON cannot be read: an
        // unreadable cache row must not stop a running pod.
        let mut wanted = HashSet::new();
        for pod in pods.iter().filter(|p| !p.index.deleting) {
            wanted.insert(pod.index.uid.clone());
        }
        // One pod parsed at a time: a parsed pod is about ten times its JSON.
        for pod in pods.iter().filter(|p| !p.index.deleting) {
            let parsed: Value = match serde_json::from_str(&pod.raw) {
                Ok(v) => v,
                Err(e) => {
                    tracing::warn!(pod = %pod.index.name, error = %e, "cached pod is not valid JSON; leaving it as it runs");
                    continue;
                }
            };
            let raw = &parsed;
            let waiting = self
                .refused
                .get(&pod.index.uid)
                .and_then(|r| r.next_allowed)
                .is_some_and(|t| Instant::now() < t);
            if waiting {
                continue;
            }
            match self
                .ensure_pod(pod, raw, &sandboxes, &containers, &mut pass)
                .await
            {
                Ok(plan) => {
                    self.probe_pod(pod, &plan, &containers, &mut pass).await?;
                    let status = self.observe(&plan, &sandboxes, &containers).await?;
                    self.queue_status(pod, raw, status)?;
                    self.reported.remove(&pod.index.uid);
                    self.refused.remove(&pod.index.uid);
                }
                Err(EnsureError::Plan(e)) => {
                    let (reason, message) = match &e {
                        PlanError::Unsupported(u) => (
                            "UnsupportedField",
                            format!("edgehub cannot run this pod: {u}"),
                        ),
                        PlanError::Missing(m) => {
                            (m.reason, format!("edgehub cannot start this pod yet: {m}"))
                        }
                    };
                    // A source that is merely on its way is not worth a Warning.
                    let quiet = matches!(&e, PlanError::Missing(m) if !m.known_absent);
                    if !quiet && self.reported.get(&pod.index.uid) != Some(&message) {
                        tracing::warn!(pod = %pod.index.name, namespace = %pod.index.namespace, reason, %message, "pod cannot run");
                        self.queue_warning(pod, reason, &message)?;
                        self.reported.insert(pod.index.uid.clone(), message.clone());
                    }
                    self.queue_status(pod, raw, blocked_status(reason, &message))?;
                    match e {
                        PlanError::Unsupported(u) => {
                            pass.unsupported.push((pod.index.name.clone(), u))
                        }
                        PlanError::Missing(m) => pass.missing.push((pod.index.name.clone(), m)),
                    }
                }
                // The runtime refused this pod (an image it cannot pull, a config it cannot
                // create): the pod says why, and the other pods carry on. A runtime that is
                // down fails the whole pass instead.
                Err(EnsureError::Runtime(RuntimeError::Cri(e))) if !e.is_unavailable() => {
                    self.pod_failed(pod, raw, pod_failure_reason(&e), e.to_string(), &mut pass)?
                }
                // The host refused the pod's volumes (a hostPath of the wrong type, a full
                // disk): the kubelet's FailedMount, retried like the above.
                Err(EnsureError::Volume(u)) => {
                    self.pod_failed(pod, raw, "FailedMount", u.to_string(), &mut pass)?
                }
                Err(EnsureError::Runtime(e)) => return Err(e),
            }
        }

        self.probes.retain(|(uid, _), _| wanted.contains(uid));
        self.refused.retain(|uid, _| wanted.contains(uid));

        // Sandboxes of pods that are gone or being deleted: stop within the grace period and
        // remove. Deleting pods are then finished on the apiserver.
        let grace: HashMap<&str, i64> = pods
            .iter()
            .map(|p| (p.index.uid.as_str(), grace_of(&p.raw)))
            .collect();
        let mut stopped = HashSet::new();
        for sb in &sandboxes {
            let uid = sb.labels.get(labels::POD_UID).cloned().unwrap_or_default();
            if wanted.contains(&uid) {
                continue;
            }
            let g = grace.get(uid.as_str()).copied().unwrap_or(0);
            for c in containers.iter().filter(|c| c.pod_sandbox_id == sb.id) {
                self.ignore_missing(self.cri.stop_container(&c.id, g).await)?;
                self.ignore_missing(self.cri.remove_container(&c.id).await)?;
            }
            self.ignore_missing(self.cri.stop_pod_sandbox(&sb.id).await)?;
            self.ignore_missing(self.cri.remove_pod_sandbox(&sb.id).await)?;
            if stopped.insert(uid.clone()) {
                pass.pods_removed += 1;
                tracing::info!(pod_uid = %uid, "pod stopped and removed");
                self.restarts.retain(|(u, _), _| *u != uid);
            }
        }
        for pod in pods.iter().filter(|p| p.index.deleting) {
            let has_sandbox = sandboxes.iter().any(|s| {
                s.labels.get(labels::POD_UID) == Some(&pod.index.uid)
                    && !stopped.contains(&pod.index.uid)
            });
            if !has_sandbox && self.finalize(pod).await {
                pass.pods_finalized += 1;
                let _ = std::fs::remove_dir_all(self.pod_dir(&pod.index.uid));
            }
        }
        pass.statuses_sent = self.send_statuses().await?;
        pass.events_sent = self.send_events().await?;
        Ok(pass)
    }

    /// Delivers queued Events while the apiserver answers; keeps them otherwise (the queue is
    /// in the store, so they survive a restart). An Event's name is fixed per pod and reason,
    /// so a resend after a crash is an AlreadyExists, not a duplicate.
    async fn send_events(&mut self) -> Result<usize, RuntimeError> {
        let Some(client) = &self.client else {
            return Ok(0);
        };
        let mut sent = 0;
        for ev in self.store.queued_events()? {
            match client
                .create(
                    &crate::kube::resource::EVENTS,
                    Some(&ev.namespace),
                    ev.body.clone().into_bytes(),
                )
                .await
            {
                Ok(_) => {
                    sent += 1;
                    self.store.event_sent(&ev.key)?;
                }
                Err(e) if e.code() == Some(409) => self.store.event_sent(&ev.key)?,
                Err(e) if e.is_offline() => break,
                Err(e) if matches!(e.code(), Some(400 | 403 | 404 | 422)) => {
                    // The apiserver will never take it; keeping it would block the queue.
                    tracing::warn!(error = %e, key = %ev.key, "Event refused; dropped");
                    self.store.event_sent(&ev.key)?;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot post an Event; will retry");
                    break;
                }
            }
        }
        Ok(sent)
    }

    /// Queues the pod's status if it differs from what the apiserver has: the status of
    /// `cached`, the pod as this pass parsed it.
    fn queue_status(
        &self,
        pod: &StoredObject,
        cached: &Value,
        status: Value,
    ) -> Result<(), RuntimeError> {
        let have = cached.get("status").unwrap_or(&Value::Null);
        // Already what the apiserver holds: nothing to send, nothing to write.
        let covered = status.as_object().is_some_and(|m| {
            m.iter().all(|(k, v)| match (k.as_str(), v) {
                ("conditions", Value::Array(want)) => want.iter().all(|w| {
                    have["conditions"].as_array().is_some_and(|hc| {
                        hc.iter().any(|h| {
                            h["type"] == w["type"]
                                && h["status"] == w["status"]
                                && h.get("reason") == w.get("reason")
                        })
                    })
                }),
                (k, v) => have.get(k) == Some(&without_nulls(v)),
            })
        });
        if covered {
            return Ok(());
        }
        let patch = serde_json::json!({"status": status}).to_string();
        self.store.queue_status(&crate::store::QueuedStatus {
            pod_uid: pod.index.uid.clone(),
            namespace: pod.index.namespace.clone(),
            name: pod.index.name.clone(),
            patch,
        })?;
        Ok(())
    }

    /// Sends queued status patches while the apiserver answers; keeps them when it does not.
    async fn send_statuses(&self) -> Result<usize, RuntimeError> {
        let Some(client) = &self.client else {
            return Ok(0);
        };
        let mut sent = 0;
        for q in self.store.queued_statuses()? {
            match client
                .patch(
                    &PODS,
                    Some(&q.namespace),
                    &q.name,
                    Some("status"),
                    crate::kube::PatchType::StrategicMerge,
                    q.patch.clone().into_bytes(),
                )
                .await
            {
                Ok(_) => {
                    self.store.status_sent(&q.pod_uid, &q.patch)?;
                    sent += 1;
                }
                // The pod is gone (the Node authorizer answers 403 for pods not bound here).
                Err(e) if matches!(e.code(), Some(404) | Some(403)) => {
                    tracing::info!(pod = %q.name, namespace = %q.namespace, "pod gone; dropping its queued status");
                    self.store.status_sent(&q.pod_uid, &q.patch)?;
                }
                Err(e) if e.is_offline() => break,
                Err(e) => {
                    tracing::warn!(pod = %q.name, error = %e, "pod status patch failed; will retry");
                    break;
                }
            }
        }
        Ok(sent)
    }

    /// What the runtime shows of a pod, as a status.
    async fn observe(
        &self,
        plan: &PodPlan,
        sandboxes: &[api::PodSandbox],
        containers: &[api::Container],
    ) -> Result<Value, CriError> {
        let sandbox = sandboxes
            .iter()
            .filter(|s| {
                s.labels.get(labels::POD_UID) == Some(&plan.uid)
                    && s.state == api::PodSandboxState::SandboxReady as i32
            })
            .max_by_key(|s| s.metadata.as_ref().map(|m| m.attempt).unwrap_or(0));
        let mine: Vec<&api::Container> = match sandbox {
            Some(sb) => containers
                .iter()
                .filter(|c| c.pod_sandbox_id == sb.id)
                .collect(),
            None => Vec::new(),
        };
        let views = |list: &[podspec::ContainerPlan]| {
            list.iter()
                .map(|p| (p.clone(), latest(&mine, &p.name).cloned()))
                .collect::<Vec<_>>()
        };
        let (init, app) = (views(&plan.init_containers), views(&plan.containers));
        let mut to_view = Vec::new();
        for group in [&init, &app] {
            let mut out = Vec::new();
            for (p, c) in group.iter() {
                out.push(self.view(&plan.uid, p, c.as_ref()).await?);
            }
            to_view.push(out);
        }
        let app_views = to_view.pop().unwrap_or_default();
        let init_views = to_view.pop().unwrap_or_default();
        Ok(pod_status(
            &init_views,
            &app_views,
            self.host_ip.as_deref(),
            plan.pod_ip.as_deref(),
            sandbox.map(|s| nanos_to_rfc3339(s.created_at)).as_deref(),
            plan.restart_policy,
        ))
    }

    async fn view(
        &self,
        uid: &str,
        p: &podspec::ContainerPlan,
        c: Option<&api::Container>,
    ) -> Result<ContainerView, CriError> {
        let creating = || ViewState::Waiting {
            reason: "ContainerCreating".into(),
        };
        let Some(c) = c else {
            return Ok(ContainerView {
                name: p.name.clone(),
                image: p.image.clone(),
                image_id: String::new(),
                restart_count: 0,
                state: creating(),
                ready: false,
            });
        };
        let st = match self.cri.container_status(&c.id).await {
            Ok(s) => s,
            Err(e) if e.is_not_found() => None,
            Err(e) => return Err(e),
        };
        let state = match &st {
            Some(s) if s.state == api::ContainerState::ContainerRunning as i32 => {
                ViewState::Running {
                    started_at: nanos_to_rfc3339(s.started_at),
                }
            }
            Some(s) if s.state == api::ContainerState::ContainerExited as i32 => {
                ViewState::Terminated {
                    exit_code: s.exit_code,
                    reason: if s.reason.is_empty() {
                        if s.exit_code == 0 {
                            "Completed".into()
                        } else {
                            "Error".into()
                        }
                    } else {
                        s.reason.clone()
                    },
                    started_at: nanos_to_rfc3339(s.started_at),
                    finished_at: nanos_to_rfc3339(s.finished_at),
                }
            }
            _ => creating(),
        };
        let passing = match &p.readiness {
            None => true,
            Some(_) => {
                self.probes
                    .get(&(uid.to_string(), p.name.clone()))
                    .filter(|e| e.id == c.id)
                    .and_then(|e| e.readiness.as_ref())
                    .and_then(|s| s.verdict)
                    == Some(true)
            }
        };
        let ready = matches!(state, ViewState::Running { .. }) && passing;
        Ok(ContainerView {
            name: p.name.clone(),
            image: p.image.clone(),
            image_id: st.map(|s| s.image_ref).unwrap_or_default(),
            restart_count: c.metadata.as_ref().map(|m| m.attempt).unwrap_or(0),
            state,
            ready,
        })
    }

    fn ignore_missing(&self, r: Result<(), CriError>) -> Result<(), CriError> {
        match r {
            Err(e) if e.is_not_found() => Ok(()),
            other => other,
        }
    }

    /// Finishes the deletion of a pod on the apiserver: DELETE with grace 0 and a uid
    /// precondition. Returns whether it is done (gone, or someone else finished it).
    async fn finalize(&self, pod: &StoredObject) -> bool {
        let Some(client) = &self.client else {
            return false;
        };
        match client
            .delete(
                &PODS,
                Some(&pod.index.namespace),
                &pod.index.name,
                Some(&pod.index.uid),
                Some(0),
            )
            .await
        {
            Ok(_) => {
                tracing::info!(pod = %pod.index.name, namespace = %pod.index.namespace, "pod deletion finished on the apiserver");
                true
            }
            Err(e) if matches!(e.code(), Some(404) | Some(409)) => true,
            Err(e) => {
                tracing::debug!(pod = %pod.index.name, error = %e, "cannot finish the pod's deletion yet");
                false
            }
        }
    }

    async fn ensure_pod(
        &mut self,
        pod: &StoredObject,
        raw: &Value,
        sandboxes: &[api::PodSandbox],
        containers: &[api::Container],
        pass: &mut Pass,
    ) -> Result<PodPlan, EnsureError> {
        let uid = &pod.index.uid;
        let mine: Vec<&api::PodSandbox> = sandboxes
            .iter()
            .filter(|s| s.labels.get(labels::POD_UID) == Some(uid))
            .collect();
        let ready = mine
            .iter()
            .filter(|s| s.state == api::PodSandboxState::SandboxReady as i32)
            .max_by_key(|s| s.metadata.as_ref().map(|m| m.attempt).unwrap_or(0));
        let attempt = mine
            .iter()
            .filter_map(|s| s.metadata.as_ref().map(|m| m.attempt + 1))
            .max()
            .unwrap_or(0);
        let host_network = raw
            .pointer("/spec/hostNetwork")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let pod_ip = match ready {
            Some(sb) if !host_network => self.sandbox_ip(&sb.id).await?,
            _ => None,
        };
        let mut ctx = PodContext {
            node_name: self.node_name.clone(),
            host_ip: self.host_ip.clone(),
            volume_dir: self.pod_dir(uid).join("volumes"),
            log_dir: self.pod_dir(uid).join("logs"),
            attempt,
            pod_ip,
            sources: fetch::load(&self.store, pod, raw).map_err(RuntimeError::from)?,
        };
        let mut plan = podspec::translate(raw, &ctx).map_err(EnsureError::Plan)?;

        let sandbox_id = match ready {
            Some(s) => {
                pass.volumes_updated +=
                    crate::volumes::refresh_files(&plan).map_err(EnsureError::Volume)?;
                s.id.clone()
            }
            None => {
                // Old, not-ready sandboxes of this pod go first (their containers with them).
                for old in &mine {
                    for c in containers.iter().filter(|c| c.pod_sandbox_id == old.id) {
                        self.ignore_missing(self.cri.remove_container(&c.id).await)?;
                    }
                    self.ignore_missing(self.cri.stop_pod_sandbox(&old.id).await)?;
                    self.ignore_missing(self.cri.remove_pod_sandbox(&old.id).await)?;
                }
                crate::volumes::prepare(&plan, &ctx).map_err(EnsureError::Volume)?;
                let id = self.cri.run_pod_sandbox(plan.sandbox.clone()).await?;
                tracing::info!(pod = %plan.name, namespace = %plan.namespace, sandbox = %id, attempt, "sandbox started");
                pass.sandboxes_created += 1;
                if !host_network {
                    // The address CNI gave the sandbox, for status.podIP in env and status.
                    ctx.pod_ip = self.sandbox_ip(&id).await?;
                    plan = podspec::translate(raw, &ctx).map_err(EnsureError::Plan)?;
                }
                id
            }
        };
        self.ensure_containers(&sandbox_id, &plan, containers, pass)
            .await?;
        Ok(plan)
    }

    /// The sandbox's pod-network address, if it has one.
    async fn sandbox_ip(&self, id: &str) -> Result<Option<String>, CriError> {
        let st = match self.cri.pod_sandbox_status(id).await {
            Ok(s) => s,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(e),
        };
        Ok(st
            .and_then(|s| s.network)
            .map(|n| n.ip)
            .filter(|ip| !ip.is_empty()))
    }

    /// Creates, starts and restarts the pod's containers in its sandbox.
    async fn ensure_containers(
        &mut self,
        sandbox_id: &str,
        plan: &PodPlan,
        containers: &[api::Container],
        pass: &mut Pass,
    ) -> Result<(), CriError> {
        let in_sandbox: Vec<&api::Container> = containers
            .iter()
            .filter(|c| c.pod_sandbox_id == sandbox_id)
            .collect();

        // Init containers run one at a time, each to success, before the app containers.
        for ic in &plan.init_containers {
            match latest(&in_sandbox, &ic.name) {
                None => {
                    self.create_and_start(sandbox_id, plan, ic, 0).await?;
                    pass.containers_started += 1;
                    return Ok(());
                }
                Some(c) if c.state == api::ContainerState::ContainerExited as i32 => {
                    let code = self.exit_code(&c.id).await?;
                    if code == 0 {
                        continue;
                    }
                    if plan.restart_policy == RestartPolicy::Never {
                        return Ok(());
                    }
                    if self.restart(sandbox_id, plan, ic, c).await? {
                        pass.containers_restarted += 1;
                    }
                    return Ok(());
                }
                Some(_) => return Ok(()),
            }
        }
        for pc in &plan.containers {
            match latest(&in_sandbox, &pc.name) {
                None => {
                    self.create_and_start(sandbox_id, plan, pc, 0).await?;
                    pass.containers_started += 1;
                }
                Some(c) if c.state == api::ContainerState::ContainerCreated as i32 => {
                    self.cri.start_container(&c.id).await?;
                    pass.containers_started += 1;
                }
                Some(c) if c.state == api::ContainerState::ContainerExited as i32 => {
                    let restart = match plan.restart_policy {
                        RestartPolicy::Always => true,
                        RestartPolicy::OnFailure => self.exit_code(&c.id).await? != 0,
                        RestartPolicy::Never => false,
                    };
                    if restart && self.restart(sandbox_id, plan, pc, c).await? {
                        pass.containers_restarted += 1;
                    }
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    async fn exit_code(&self, id: &str) -> Result<i32, CriError> {
        Ok(self
            .cri
            .container_status(id)
            .await?
            .map(|s| s.exit_code)
            .unwrap_or(-1))
    }

    /// Replaces an exited container with the next attempt, once its backoff has passed.
    async fn restart(
        &mut self,
        sandbox_id: &str,
        plan: &PodPlan,
        c: &podspec::ContainerPlan,
        old: &api::Container,
    ) -> Result<bool, CriError> {
        let key = (plan.uid.clone(), c.name.clone());
        let now = Instant::now();
        let state = self.restarts.entry(key.clone()).or_default();
        match state.next_allowed {
            None => {
                state.count += 1;
                state.next_allowed = Some(now + self.backoff.delay(state.count));
                tracing::info!(pod = %plan.name, container = %c.name, restarts = state.count,
                    wait_ms = self.backoff.delay(state.count).as_millis() as u64, "container exited; restarting after backoff");
                return Ok(false);
            }
            Some(t) if now < t => return Ok(false),
            Some(_) => {}
        }
        let attempt = old.metadata.as_ref().map(|m| m.attempt + 1).unwrap_or(1);
        self.ignore_missing(self.cri.remove_container(&old.id).await)?;
        self.create_and_start(sandbox_id, plan, c, attempt).await?;
        if let Some(s) = self.restarts.get_mut(&key) {
            s.next_allowed = None;
        }
        tracing::info!(pod = %plan.name, container = %c.name, attempt, "container restarted");
        Ok(true)
    }

    async fn create_and_start(
        &self,
        sandbox_id: &str,
        plan: &PodPlan,
        c: &podspec::ContainerPlan,
        attempt: u32,
    ) -> Result<(), CriError> {
        let present = self.cri.image_status(&c.image).await?.is_some();
        match (c.pull_policy, present) {
            (PullPolicy::Never, false) => {
                return Err(CriError::Call {
                    method: "CreateContainer",
                    code: "ImageNotPresent".into(),
                    message: format!(
                        "image {} is not on the node and imagePullPolicy is Never",
                        c.image
                    ),
                })
            }
            (PullPolicy::Always, _) | (PullPolicy::IfNotPresent, false) => {
                // No server_address: the credentials were already matched to the image's
                // registry, and containerd parses that field as a URL, so a plain
                // `host:port` (the usual docker config key) makes every pull fail.
                let auth = c.auth.as_ref().map(|a| api::AuthConfig {
                    username: a.username.clone(),
                    password: a.password.clone(),
                    ..Default::default()
                });
                self.cri.pull_image(&c.image, auth).await?;
            }
            _ => {}
        }
        let mut cfg = c.config.clone();
        if let Some(m) = cfg.metadata.as_mut() {
            m.attempt = attempt;
        }
        cfg.log_path = format!("{}_{attempt}.log", c.name);
        let id = self
            .cri
            .create_container(sandbox_id, cfg, plan.sandbox.clone())
            .await?;
        self.cri.start_container(&id).await?;
        tracing::info!(pod = %plan.name, namespace = %plan.namespace, container = %c.name, id = %id, attempt, "container started");
        Ok(())
    }
}

/// The kubelet's reason for a pod the runtime refused.
pub fn pod_failure_reason(e: &CriError) -> &'static str {
    match e {
        CriError::Call {
            method: "PullImage",
            ..
        }
        | CriError::Timeout {
            method: "PullImage",
            ..
        } => "ErrImagePull",
        CriError::Call { code, .. } if code == "ImageNotPresent" => "ErrImageNeverPull",
        CriError::Call {
            method: "RunPodSandbox",
            ..
        } => "FailedCreatePodSandBox",
        CriError::Call {
            method: "StartContainer",
            ..
        } => "RunContainerError",
        _ => "CreateContainerError",
    }
}

/// When the loop wakes for the next probe: never sooner than shortly after now, so a probe
/// that could not run (the runtime is down) cannot turn the loop into a busy one.
pub fn probe_wake(next_due: Option<Instant>, now: Instant) -> Option<Instant> {
    next_due.map(|t| t.max(now + Duration::from_millis(200)))
}

/// A container as the pod status reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerView {
    pub name: String,
    pub image: String,
    pub image_id: String,
    pub restart_count: u32,
    pub state: ViewState,
    /// Running and, when it has a readiness probe, passing it.
    pub ready: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ViewState {
    Waiting {
        reason: String,
    },
    Running {
        started_at: String,
    },
    Terminated {
        exit_code: i32,
        reason: String,
        started_at: String,
        finished_at: String,
    },
}

/// A container state, with the other two states explicitly null: a strategic merge patch
/// merges maps, so without the nulls an old `waiting` would stay beside a new `running`.
fn state_json(s: &ViewState) -> Value {
    let mut out = serde_json::json!({"waiting": null, "running": null, "terminated": null});
    match s {
        ViewState::Waiting { reason } => out["waiting"] = serde_json::json!({"reason": reason}),
        ViewState::Running { started_at } => {
            out["running"] = serde_json::json!({"startedAt": started_at})
        }
        ViewState::Terminated {
            exit_code,
            reason,
            started_at,
            finished_at,
        } => {
            out["terminated"] = serde_json::json!({
                "exitCode": exit_code, "reason": reason, "startedAt": started_at, "finishedAt": finished_at
            })
        }
    }
    out
}

/// `v` without null members, as the apiserver stores a patched object.
fn without_nulls(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(_, x)| !x.is_null())
                .map(|(k, x)| (k.clone(), without_nulls(x)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(without_nulls).collect()),
        other => other.clone(),
    }
}

fn container_status_json(c: &ContainerView) -> Value {
    let running = matches!(c.state, ViewState::Running { .. });
    let ready = c.ready;
    serde_json::json!({
        "name": c.name,
        "image": c.image,
        "imageID": c.image_id,
        "restartCount": c.restart_count,
        "ready": ready,
        "started": running,
        "state": state_json(&c.state),
    })
}

/// The `status` of a pod edgehub runs (a host-network pod's podIP is the host's). Pure, so the
/// phase and condition rules are unit-tested. No transition times: an unchanged pod has an
/// unchanged status, and an unchanged status is never re-sent.
pub fn pod_status(
    init: &[ContainerView],
    app: &[ContainerView],
    host_ip: Option<&str>,
    pod_ip: Option<&str>,
    start_time: Option<&str>,
    restart_policy: RestartPolicy,
) -> Value {
    let init_done = init
        .iter()
        .all(|c| matches!(c.state, ViewState::Terminated { exit_code: 0, .. }));
    let all_ready = !app.is_empty() && app.iter().all(|c| c.ready);
    let all_done = !app.is_empty()
        && app
            .iter()
            .all(|c| matches!(c.state, ViewState::Terminated { .. }));
    let all_ok = app
        .iter()
        .all(|c| matches!(c.state, ViewState::Terminated { exit_code: 0, .. }));
    let phase = if all_done && restart_policy != RestartPolicy::Always {
        if all_ok {
            "Succeeded"
        } else {
            "Failed"
        }
    } else if init_done
        && app
            .iter()
            .any(|c| !matches!(c.state, ViewState::Waiting { .. }))
    {
        "Running"
    } else {
        "Pending"
    };
    let tf = |b: bool| if b { "True" } else { "False" };
    let mut status = serde_json::json!({
        "phase": phase,
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Initialized", "status": tf(init_done)},
            {"type": "ContainersReady", "status": tf(all_ready)},
            {"type": "Ready", "status": tf(all_ready)},
        ],
        "containerStatuses": app.iter().map(container_status_json).collect::<Vec<_>>(),
    });
    if !init.is_empty() {
        status["initContainerStatuses"] =
            Value::Array(init.iter().map(container_status_json).collect());
    }
    if let Some(ip) = host_ip {
        status["hostIP"] = ip.into();
        status["hostIPs"] = serde_json::json!([{"ip": ip}]);
    }
    if let Some(ip) = pod_ip {
        status["podIP"] = ip.into();
        status["podIPs"] = serde_json::json!([{"ip": ip}]);
    }
    if let Some(t) = start_time {
        status["startTime"] = t.into();
    }
    status
}

/// The status of a pod edgehub cannot run or cannot start yet: Ready=False with the reason.
pub fn blocked_status(reason: &str, message: &str) -> Value {
    serde_json::json!({
        "phase": "Pending",
        "conditions": [
            {"type": "Ready", "status": "False", "reason": reason, "message": message},
        ],
    })
}

/// The status of a pod edgehub cannot run: Ready=False naming the field.
pub fn unsupported_status(u: &Unsupported) -> Value {
    blocked_status(
        "UnsupportedField",
        &format!("edgehub cannot run this pod: {u}"),
    )
}

/// A Warning Event about a pod. Its name is fixed per pod and reason, so a resend is an
/// AlreadyExists rather than a second Event.
pub fn warning_event(
    pod: &StoredObject,
    reason: &str,
    message: &str,
    node: &str,
    now: &str,
) -> Value {
    let ix = &pod.index;
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": format!("{}.edgehub-{}", ix.name, reason.to_ascii_lowercase()), "namespace": ix.namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": ix.namespace, "name": ix.name, "uid": ix.uid},
        "reason": reason,
        "message": message,
        "type": "Warning",
        "source": {"component": "edgehub", "host": node},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    })
}

/// The Warning Event about a pod edgehub cannot run.
pub fn unsupported_event(pod: &StoredObject, u: &Unsupported, node: &str, now: &str) -> Value {
    warning_event(
        pod,
        "UnsupportedField",
        &format!("edgehub cannot run this pod: {u}"),
        node,
        now,
    )
}

fn nanos_to_rfc3339(n: i64) -> String {
    crate::time::rfc3339(std::time::UNIX_EPOCH + Duration::from_nanos(n.max(0) as u64))
}

#[derive(Debug)]
enum EnsureError {
    Plan(PlanError),
    /// Preparing the volumes on the host failed.
    Volume(Unsupported),
    Runtime(RuntimeError),
}

impl From<RuntimeError> for EnsureError {
    fn from(e: RuntimeError) -> Self {
        EnsureError::Runtime(e)
    }
}

impl From<CriError> for EnsureError {
    fn from(e: CriError) -> Self {
        EnsureError::Runtime(RuntimeError::Cri(e))
    }
}

/// The newest attempt of container `name` among `cs`.
fn latest<'a>(cs: &[&'a api::Container], name: &str) -> Option<&'a api::Container> {
    cs.iter()
        .filter(|c| c.labels.get(labels::CONTAINER_NAME).map(String::as_str) == Some(name))
        .max_by_key(|c| c.metadata.as_ref().map(|m| m.attempt).unwrap_or(0))
        .copied()
}

fn grace_of(raw: &str) -> i64 {
    serde_json::from_str::<Value>(raw)
        .ok()
        .and_then(|v| {
            v.pointer("/metadata/deletionGracePeriodSeconds")
                .or_else(|| v.pointer("/spec/terminationGracePeriodSeconds"))
                .and_then(Value::as_i64)
        })
        .unwrap_or(30)
        .max(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_in_the_past_does_not_spin_the_loop() {
        let now = Instant::now();
        let past = now - Duration::from_secs(60);
        assert_eq!(
            probe_wake(Some(past), now),
            Some(now + Duration::from_millis(200))
        );
        let later = now + Duration::from_secs(2);
        assert_eq!(probe_wake(Some(later), now), Some(later));
        assert_eq!(probe_wake(None, now), None);
    }

    #[test]
    fn crash_loop_backoff_doubles_to_the_cap() {
        let b = BackoffPolicy::default();
        let d: Vec<u64> = (1..=7).map(|n| b.delay(n).as_secs()).collect();
        assert_eq!(d, [10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(b.delay(1000).as_secs(), 300);
    }

    fn view(name: &str, state: ViewState) -> ContainerView {
        ContainerView {
            name: name.into(),
            image: "img:1".into(),
            image_id: "img@sha256:x".into(),
            restart_count: 0,
            ready: matches!(state, ViewState::Running { .. }),
            state,
        }
    }

    fn running() -> ViewState {
        ViewState::Running {
            started_at: "t".into(),
        }
    }

    fn exited(code: i32) -> ViewState {
        ViewState::Terminated {
            exit_code: code,
            reason: "r".into(),
            started_at: "a".into(),
            finished_at: "b".into(),
        }
    }

    fn cond(s: &Value, t: &str) -> String {
        s["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == t)
            .unwrap()["status"]
            .as_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn pod_phases_and_conditions() {
        let waiting = ViewState::Waiting {
            reason: "ContainerCreating".into(),
        };
        let s = pod_status(
            &[],
            &[view("a", waiting.clone())],
            Some("10.0.0.7"),
            Some("10.0.0.7"),
            None,
            RestartPolicy::Always,
        );
        assert_eq!(
            (s["phase"].as_str(), cond(&s, "Ready").as_str()),
            (Some("Pending"), "False")
        );
        assert_eq!(s["podIP"], "10.0.0.7");
        assert_eq!(
            s["containerStatuses"][0]["state"]["waiting"]["reason"],
            "ContainerCreating"
        );

        let s = pod_status(
            &[],
            &[view("a", running()), view("b", running())],
            None,
            None,
            Some("t0"),
            RestartPolicy::Always,
        );
        assert_eq!(
            (s["phase"].as_str(), cond(&s, "Ready").as_str()),
            (Some("Running"), "True")
        );
        assert_eq!(s["startTime"], "t0");
        assert_eq!(s["containerStatuses"][1]["imageID"], "img@sha256:x");

        let s = pod_status(
            &[],
            &[view("a", running()), view("b", exited(1))],
            None,
            None,
            None,
            RestartPolicy::Always,
        );
        assert_eq!(
            (s["phase"].as_str(), cond(&s, "ContainersReady").as_str()),
            (Some("Running"), "False")
        );

        let s = pod_status(
            &[],
            &[view("a", exited(0))],
            None,
            None,
            None,
            RestartPolicy::Never,
        );
        assert_eq!(s["phase"], "Succeeded");
        let s = pod_status(
            &[],
            &[view("a", exited(2))],
            None,
            None,
            None,
            RestartPolicy::OnFailure,
        );
        assert_eq!(s["phase"], "Failed");

        // Init containers gate everything.
        let s = pod_status(
            &[view("i", running())],
            &[view("a", waiting)],
            None,
            None,
            None,
            RestartPolicy::Always,
        );
        assert_eq!(
            (s["phase"].as_str(), cond(&s, "Initialized").as_str()),
            (Some("Pending"), "False")
        );
        assert_eq!(s["initContainerStatuses"][0]["name"], "i");
        let s = pod_status(
            &[view("i", exited(0))],
            &[view("a", running())],
            None,
            None,
            None,
            RestartPolicy::Always,
        );
        assert_eq!(cond(&s, "Initialized"), "True");
    }

    #[test]
    fn unsupported_pods_say_which_field() {
        let s = unsupported_status(&Unsupported {
            field: "spec.volumes[1].configMap".into(),
            reason: "not yet".into(),
        });
        assert_eq!(s["conditions"][0]["reason"], "UnsupportedField");
        assert!(s["conditions"][0]["message"]
            .as_str()
            .unwrap()
            .contains("spec.volumes[1].configMap"));
    }

    mod with_fake_cri {
        use super::*;
        use crate::cri::fake::FakeCri;
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
                    labels: HashMap::from([(
                        labels::MANAGED_BY.to_string(),
                        "edgehub".to_string(),
                    )]),
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
            let v: Value = serde_json::from_str(&q[0].patch).unwrap();
            assert_eq!(v["status"]["phase"], "Running");
            assert_eq!(
                v["status"]["containerStatuses"][0]["imageID"],
                "fake@sha256:1"
            );
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
            let v: Value = serde_json::from_str(&bad_status.patch).unwrap();
            assert_eq!(v["status"]["conditions"][0]["reason"], "FailedMount");
            assert_eq!(store.queued_events().unwrap().len(), 1);
        }
    }

    #[test]
    fn grace_periods() {
        assert_eq!(
            grace_of(
                r#"{"metadata":{"deletionGracePeriodSeconds":7},"spec":{"terminationGracePeriodSeconds":5}}"#
            ),
            7
        );
        assert_eq!(
            grace_of(r#"{"spec":{"terminationGracePeriodSeconds":5}}"#),
            5
        );
        assert_eq!(grace_of("{}"), 30);
        assert_eq!(grace_of("nope"), 30);
    }
}
