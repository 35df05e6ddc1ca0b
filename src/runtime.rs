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
    self, PodContext, PodPlan, PullPolicy, RestartPolicy, Unsupported, VolumePlan,
};
use crate::store::{Store, StoredObject};
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
    reported: HashSet<String>,
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
            reported: HashSet::new(),
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
            tokio::select! {
                _ = tick.tick() => {}
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
                }
            }
        }
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

        let mut wanted = HashSet::new();
        for pod in &pods {
            let raw: Value = match serde_json::from_str(&pod.raw) {
                Ok(v) => v,
                Err(_) => continue,
            };
            if pod.index.deleting {
                continue;
            }
            wanted.insert(pod.index.uid.clone());
            if let Err(u) = self
                .ensure_pod(pod, &raw, &sandboxes, &containers, &mut pass)
                .await
            {
                match u {
                    EnsureError::Unsupported(u) => {
                        if self.reported.insert(pod.index.uid.clone()) {
                            tracing::warn!(pod = %pod.index.name, namespace = %pod.index.namespace, field = %u.field, reason = %u.reason,
                                "pod cannot run on edgehub");
                        }
                        pass.unsupported.push((pod.index.name.clone(), u));
                    }
                    EnsureError::Runtime(e) => return Err(e),
                }
            }
        }

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
        Ok(pass)
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
    ) -> Result<(), EnsureError> {
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
        let ctx = PodContext {
            node_name: self.node_name.clone(),
            host_ip: self.host_ip.clone(),
            volume_dir: self.pod_dir(uid).join("volumes"),
            log_dir: self.pod_dir(uid).join("logs"),
            attempt,
        };
        let plan = podspec::translate(raw, &ctx).map_err(EnsureError::Unsupported)?;
        self.reported.remove(uid);

        let sandbox_id = match ready {
            Some(s) => s.id.clone(),
            None => {
                // Old, not-ready sandboxes of this pod go first (their containers with them).
                for old in &mine {
                    for c in containers.iter().filter(|c| c.pod_sandbox_id == old.id) {
                        self.ignore_missing(self.cri.remove_container(&c.id).await)?;
                    }
                    self.ignore_missing(self.cri.stop_pod_sandbox(&old.id).await)?;
                    self.ignore_missing(self.cri.remove_pod_sandbox(&old.id).await)?;
                }
                prepare_volumes(&plan, &ctx).map_err(EnsureError::Unsupported)?;
                let id = self.cri.run_pod_sandbox(plan.sandbox.clone()).await?;
                tracing::info!(pod = %plan.name, namespace = %plan.namespace, sandbox = %id, attempt, "sandbox started");
                pass.sandboxes_created += 1;
                id
            }
        };
        let in_sandbox: Vec<&api::Container> = containers
            .iter()
            .filter(|c| c.pod_sandbox_id == sandbox_id)
            .collect();

        // Init containers run one at a time, each to success, before the app containers.
        for ic in &plan.init_containers {
            match latest(&in_sandbox, &ic.name) {
                None => {
                    self.create_and_start(&sandbox_id, &plan, ic, 0).await?;
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
                    if self.restart(&sandbox_id, &plan, ic, c).await? {
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
                    self.create_and_start(&sandbox_id, &plan, pc, 0).await?;
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
                    if restart && self.restart(&sandbox_id, &plan, pc, c).await? {
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
                self.cri.pull_image(&c.image, None).await?;
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

#[derive(Debug)]
enum EnsureError {
    Unsupported(Unsupported),
    Runtime(RuntimeError),
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

/// Creates what the volumes need on the host and checks hostPath types.
fn prepare_volumes(plan: &PodPlan, ctx: &PodContext) -> Result<(), Unsupported> {
    use std::os::unix::fs::{DirBuilderExt, FileTypeExt};
    let fail = |name: &str, reason: String| Unsupported {
        field: format!("volume {name}"),
        reason,
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o750)
        .create(&ctx.log_dir)
        .map_err(|e| {
            fail(
                "logs",
                format!("cannot create {}: {e}", ctx.log_dir.display()),
            )
        })?;
    for v in &plan.volumes {
        match v {
            VolumePlan::EmptyDir { name, path } => std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o777)
                .create(path)
                .map_err(|e| fail(name, format!("cannot create {}: {e}", path.display())))?,
            VolumePlan::HostPath { name, path, kind } => {
                let meta = std::fs::metadata(path);
                let ok = match (kind.as_str(), &meta) {
                    ("", _) => true,
                    ("DirectoryOrCreate", Err(_)) => {
                        std::fs::DirBuilder::new()
                            .recursive(true)
                            .mode(0o755)
                            .create(path)
                            .map_err(|e| {
                                fail(name, format!("cannot create {}: {e}", path.display()))
                            })?;
                        true
                    }
                    ("FileOrCreate", Err(_)) => {
                        if let Some(dir) = path.parent() {
                            let _ = std::fs::create_dir_all(dir);
                        }
                        std::fs::OpenOptions::new()
                            .create(true)
                            .append(true)
                            .open(path)
                            .map_err(|e| {
                                fail(name, format!("cannot create {}: {e}", path.display()))
                            })?;
                        true
                    }
                    ("DirectoryOrCreate" | "Directory", Ok(m)) => m.is_dir(),
                    ("FileOrCreate" | "File", Ok(m)) => m.is_file(),
                    ("Socket", Ok(m)) => m.file_type().is_socket(),
                    ("CharDevice", Ok(m)) => m.file_type().is_char_device(),
                    ("BlockDevice", Ok(m)) => m.file_type().is_block_device(),
                    (_, Err(_)) => false,
                    _ => false,
                };
                if !ok {
                    return Err(fail(
                        name,
                        format!("hostPath {} is not a {kind}", path.display()),
                    ));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_loop_backoff_doubles_to_the_cap() {
        let b = BackoffPolicy::default();
        let d: Vec<u64> = (1..=7).map(|n| b.delay(n).as_secs()).collect();
        assert_eq!(d, [10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(b.delay(1000).as_secs(), 300);
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
