//! Carries out one pod's actions, in order, against the container runtime, the host and the
//! apiserver. Each pod's actions run in their own task, so a pull that takes minutes or a stop
//! that waits out a grace period holds up that pod only.
//!
//! Every step is idempotent: an object already gone counts as removed, and what a crash left
//! behind is found again by its labels on the next snapshot.

use super::decide::{first_containers, volumes_digest, Action, StartSpec};
use crate::cri::{CriError, CriRuntime};
use crate::kube::resource::PODS;
use crate::kube::ApiClient;
use crate::pod::desired::pod_dir;
use crate::pod::probes::{self, ProbeKind};
use crate::pod::start::{create_and_start, failure_reason, ignore_missing, stop_and_remove};
use crate::podspec::{self, PlanError, PodPlan, Unsupported};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// What a pod's task needs; cheap to clone.
pub struct Env<R> {
    pub cri: Arc<R>,
    pub client: Option<ApiClient>,
    pub data_dir: PathBuf,
}

impl<R> Clone for Env<R> {
    fn clone(&self) -> Self {
        Env {
            cri: self.cri.clone(),
            client: self.client.clone(),
            data_dir: self.data_dir.clone(),
        }
    }
}

/// One probe's result.
#[derive(Debug, Clone)]
pub struct ProbeResult {
    pub container: String,
    pub container_id: String,
    pub kind: ProbeKind,
    pub at: Instant,
    pub outcome: Result<(), String>,
}

/// What one pod's task did.
#[derive(Debug, Default)]
pub struct Outcome {
    pub uid: String,
    pub sandboxes_created: usize,
    pub containers_started: usize,
    pub containers_restarted: usize,
    pub pods_removed: usize,
    pub pods_finalized: usize,
    pub volumes_updated: usize,
    /// The file volumes' digest, once written.
    pub volumes_digest: Option<u64>,
    pub probes: Vec<ProbeResult>,
    /// Containers stopped for a failed liveness probe, and why.
    pub liveness_kills: Vec<(String, String)>,
    /// The runtime or the host refused the pod: the kubelet's reason, and the message.
    pub refused: Option<(&'static str, String)>,
    /// The runtime itself is unavailable; nothing more was tried.
    pub runtime_down: Option<CriError>,
    /// Something was created or started without a refusal: the pod's refusal backoff ends.
    pub progressed: bool,
}

enum StepError {
    Cri(CriError),
    Volume(Unsupported),
    Plan(PlanError),
}

impl From<CriError> for StepError {
    fn from(e: CriError) -> Self {
        StepError::Cri(e)
    }
}

/// Runs `actions` (all for pod `uid`) in order; stops at the first refusal.
pub async fn run_pod<R: CriRuntime>(env: Env<R>, uid: String, actions: Vec<Action>) -> Outcome {
    let mut out = Outcome {
        uid,
        ..Default::default()
    };
    for action in actions {
        match step(&env, action, &mut out).await {
            Ok(()) => {}
            Err(StepError::Cri(e)) if e.is_unavailable() => {
                out.runtime_down = Some(e);
                return out;
            }
            Err(StepError::Cri(e)) => {
                out.refused = Some((failure_reason(&e), e.to_string()));
                return out;
            }
            Err(StepError::Volume(u)) => {
                out.refused = Some(("FailedMount", u.to_string()));
                return out;
            }
            Err(StepError::Plan(e)) => {
                out.refused = Some(("CreateContainerConfigError", e.to_string()));
                return out;
            }
        }
    }
    out
}

async fn step<R: CriRuntime>(
    env: &Env<R>,
    action: Action,
    out: &mut Outcome,
) -> Result<(), StepError> {
    let cri = &*env.cri;
    match action {
        Action::StartPod {
            remove_sandboxes,
            remove_containers,
            spec,
            ..
        } => {
            for c in &remove_containers {
                ignore_missing(cri.remove_container(c).await)?;
            }
            for s in &remove_sandboxes {
                ignore_missing(cri.stop_pod_sandbox(s).await)?;
                ignore_missing(cri.remove_pod_sandbox(s).await)?;
            }
            start_pod(cri, *spec, out).await?;
        }
        Action::RefreshVolumes { plan, digest, .. } => {
            out.volumes_updated +=
                crate::volumes::refresh_files(&plan).map_err(StepError::Volume)?;
            out.volumes_digest = Some(digest);
        }
        Action::CreateContainer {
            pod,
            sandbox_id,
            container,
            sandbox_config,
            attempt,
            replace,
            ..
        } => {
            if let Some(old) = &replace {
                ignore_missing(cri.remove_container(old).await)?;
            }
            create_and_start(cri, &pod, &sandbox_id, &sandbox_config, &container, attempt).await?;
            out.progressed = true;
            if replace.is_some() {
                out.containers_restarted += 1;
                tracing::info!(pod = %pod, container = %container.name, attempt, "container restarted");
            } else {
                out.containers_started += 1;
            }
        }
        Action::StartCreated { container_id, .. } => {
            cri.start_container(&container_id).await?;
            out.containers_started += 1;
            out.progressed = true;
        }
        Action::StopContainer {
            container,
            container_id,
            grace_secs,
            why,
            ..
        } => {
            tracing::warn!(pod_uid = %out.uid, container = %container, error = %why,
                "liveness probe failed; stopping the container");
            ignore_missing(cri.stop_container(&container_id, grace_secs).await)?;
            out.liveness_kills.push((container, why));
        }
        Action::Probe {
            container,
            container_id,
            kind,
            spec,
            ip,
            ..
        } => {
            let outcome = probes::run(cri, &container_id, &ip, &spec).await;
            out.probes.push(ProbeResult {
                container,
                container_id,
                kind,
                at: Instant::now(),
                outcome,
            });
        }
        Action::KillPod {
            sandboxes,
            containers,
            grace_secs,
            ..
        } => {
            stop_and_remove(cri, &sandboxes, &containers, grace_secs).await?;
            out.pods_removed += 1;
            tracing::info!(pod_uid = %out.uid, "pod stopped and removed");
        }
        Action::RemoveLeftovers {
            sandboxes,
            containers,
            grace_secs,
            ..
        } => {
            tracing::warn!(pod_uid = %out.uid, sandboxes = ?sandboxes, containers = ?containers,
                "removing what an upgrade that did not commit left behind, or a second ready sandbox");
            stop_and_remove(cri, &sandboxes, &containers, grace_secs).await?;
            out.progressed = true;
        }
        Action::Finalize {
            namespace, name, ..
        } => {
            if finalize(env.client.as_ref(), &namespace, &name, &out.uid).await {
                out.pods_finalized += 1;
                remove_pod_dir(env, &out.uid);
            }
        }
        Action::RemovePodDir { .. } => remove_pod_dir(env, &out.uid),
        // Memory-only actions never reach a task.
        Action::WaitRestart { .. }
        | Action::Blocked { .. }
        | Action::Adopt { .. }
        | Action::GiveUpAdoption { .. } => {}
    }
    Ok(())
}

fn remove_pod_dir<R>(env: &Env<R>, uid: &str) {
    let dir = match pod_dir(&env.data_dir, uid) {
        Ok(d) => d,
        Err(e) => {
            // Such a pod was refused before anything of it reached the disk.
            tracing::warn!(pod_uid = %uid, error = %e, "not removing a directory for this pod");
            return;
        }
    };
    match crate::volumes::remove_pod_dir(&dir) {
        Ok(()) => tracing::info!(pod_uid = %uid, "pod directory removed"),
        Err(e) => {
            tracing::warn!(pod_uid = %uid, dir = %dir.display(), error = %e, "cannot remove the pod directory")
        }
    }
}

/// Prepares the volumes, runs the sandbox (translating the pod again with the address CNI
/// gave it, for `status.podIP` in env), then creates and starts the first containers.
async fn start_pod<R: CriRuntime>(
    cri: &R,
    spec: StartSpec,
    out: &mut Outcome,
) -> Result<(), StepError> {
    let StartSpec {
        raw,
        mut ctx,
        mut plan,
    } = spec;
    out.volumes_updated += crate::volumes::prepare(&plan, &ctx).map_err(StepError::Volume)?;
    out.volumes_digest = Some(volumes_digest(&plan));
    let id = cri.run_pod_sandbox(plan.sandbox.clone()).await?;
    tracing::info!(pod = %plan.name, namespace = %plan.namespace, sandbox = %id, attempt = ctx.attempt, "sandbox started");
    out.sandboxes_created += 1;
    out.progressed = true;
    if !plan.host_network {
        ctx.pod_ip = match cri.pod_sandbox_status(&id).await {
            Ok(st) => st
                .and_then(|s| s.network)
                .map(|n| n.ip)
                .filter(|ip| !ip.is_empty()),
            Err(e) if e.is_not_found() => None,
            Err(e) => return Err(e.into()),
        };
        plan = retranslate(&raw, &ctx)?;
    }
    for c in first_containers(&plan) {
        create_and_start(cri, &plan.name, &id, &plan.sandbox, c, 0).await?;
        out.containers_started += 1;
    }
    Ok(())
}

fn retranslate(raw: &str, ctx: &podspec::PodContext) -> Result<PodPlan, StepError> {
    let v: serde_json::Value = serde_json::from_str(raw).map_err(|e| {
        StepError::Plan(PlanError::Unsupported(Unsupported {
            field: "pod".into(),
            reason: format!("cached JSON cannot be read: {e}"),
        }))
    })?;
    podspec::translate(&v, ctx).map_err(StepError::Plan)
}

/// Finishes the deletion of a pod on the apiserver: DELETE with grace 0 and a uid
/// precondition. Returns whether it is done (gone, or someone else finished it).
async fn finalize(client: Option<&ApiClient>, namespace: &str, name: &str, uid: &str) -> bool {
    let Some(client) = client else {
        return false;
    };
    match client
        .delete(&PODS, Some(namespace), name, Some(uid), Some(0))
        .await
    {
        Ok(_) => {
            tracing::info!(pod = %name, namespace = %namespace, "pod deletion finished on the apiserver");
            true
        }
        Err(e) if matches!(e.code(), Some(404) | Some(409)) => true,
        Err(e) => {
            tracing::debug!(pod = %name, error = %e, "cannot finish the pod's deletion yet");
            false
        }
    }
}
