//! The upgrade's I/O: what the runtime shows of the pod (for the machine), and each step,
//! carried out against the CRI. Every step is idempotent: an object already gone counts as
//! removed, and a container is told old from new by the upgrade id label it carries.

use super::machine::{Observed, Pair, Run, Seen};
use super::plan::UpgradePlan;
use crate::cri::{api, labels, CriError, CriRuntime};
use crate::podspec::{ContainerPlan, PodPlan};
use crate::runtime::probes::{self, ProbeSpec, ProbeState};
use std::collections::HashMap;
use std::time::Instant;

/// The pod's containers in its ready sandbox.
#[derive(Debug, Clone, Default)]
pub struct PodNow {
    pub sandbox: Option<api::PodSandbox>,
    pub containers: Vec<api::Container>,
}

fn attempt(c: &api::Container) -> u32 {
    c.metadata.as_ref().map(|m| m.attempt).unwrap_or(0)
}

fn named(c: &api::Container, name: &str) -> bool {
    c.labels.get(labels::CONTAINER_NAME).map(String::as_str) == Some(name)
}

fn of_upgrade(c: &api::Container, id: &str) -> bool {
    c.labels.get(labels::UPGRADE_ID).map(String::as_str) == Some(id)
}

impl PodNow {
    /// The ready sandbox to create containers in.
    fn ready_sandbox(&self) -> Result<&api::PodSandbox, CriError> {
        self.sandbox.as_ref().ok_or_else(|| CriError::Call {
            method: "CreateContainer",
            code: "NoSandbox".into(),
            message: "the pod has no ready sandbox".into(),
        })
    }

    /// The next attempt number for container `name`.
    pub fn next_attempt(&self, name: &str) -> u32 {
        self.containers
            .iter()
            .filter(|c| named(c, name))
            .map(|c| attempt(c) + 1)
            .max()
            .unwrap_or(0)
    }

    /// The newest container of `name` this upgrade made, and the newest other one.
    pub fn pair(
        &self,
        name: &str,
        upgrade_id: &str,
    ) -> (Option<&api::Container>, Option<&api::Container>) {
        let newest = |new: bool| {
            self.containers
                .iter()
                .filter(|c| named(c, name) && of_upgrade(c, upgrade_id) == new)
                .max_by_key(|c| attempt(c))
        };
        (newest(false), newest(true))
    }
}

/// Reads the pod's ready sandbox and its containers.
pub async fn pod_now<R: CriRuntime>(cri: &R, uid: &str, node: &str) -> Result<PodNow, CriError> {
    let sel = HashMap::from([
        (labels::POD_UID.to_string(), uid.to_string()),
        (labels::NODE.to_string(), node.to_string()),
    ]);
    let sandbox = cri
        .list_pod_sandbox(sel.clone())
        .await?
        .into_iter()
        .filter(|s| s.state == api::PodSandboxState::SandboxReady as i32)
        .max_by_key(|s| s.metadata.as_ref().map(|m| m.attempt).unwrap_or(0));
    let containers = match &sandbox {
        Some(sb) => cri
            .list_containers(sel)
            .await?
            .into_iter()
            .filter(|c| c.pod_sandbox_id == sb.id)
            .collect(),
        None => Vec::new(),
    };
    Ok(PodNow {
        sandbox,
        containers,
    })
}

fn run_of(state: i32) -> Run {
    match state {
        s if s == api::ContainerState::ContainerCreated as i32 => Run::Created,
        s if s == api::ContainerState::ContainerRunning as i32 => Run::Running,
        s if s == api::ContainerState::ContainerExited as i32 => Run::Exited,
        _ => Run::Unknown,
    }
}

/// Readiness probes of the new containers, run by the engine while it owns the pod.
#[derive(Debug, Default)]
pub struct Readiness {
    states: HashMap<String, (ProbeSpec, ProbeState)>,
}

impl Readiness {
    /// Runs the probe of container `id` if one is due; returns its verdict (`None` when the
    /// container has no readiness probe).
    pub async fn check<R: CriRuntime>(
        &mut self,
        cri: &R,
        id: &str,
        ip: &str,
        spec: Option<&ProbeSpec>,
    ) -> Option<bool> {
        let spec = spec?;
        let (sp, st) = self
            .states
            .entry(id.to_string())
            .or_insert_with(|| (spec.clone(), ProbeState::new(Instant::now())));
        if st.due_at(sp) <= Instant::now() {
            let outcome = probes::run(cri, id, ip, sp).await;
            let sp = sp.clone();
            st.record(Instant::now(), outcome, &sp);
        }
        Some(st.verdict == Some(true))
    }
}

/// What the machine needs: missing target images, and each changed container's old and new.
pub async fn observe<R: CriRuntime>(
    cri: &R,
    now: &PodNow,
    plan: &UpgradePlan,
    target: &PodPlan,
    upgrade_id: &str,
    check_images: bool,
    readiness: &mut Readiness,
) -> Result<Observed, CriError> {
    let mut missing = Vec::new();
    if check_images {
        for c in &plan.changes {
            if cri.image_status(&c.to).await?.is_none() && !missing.contains(&c.to) {
                missing.push(c.to.clone());
            }
        }
    }
    let ip = target.pod_ip.clone().unwrap_or_else(|| "127.0.0.1".into());
    let mut pairs = Vec::new();
    for ch in &plan.changes {
        let (old, new) = now.pair(&ch.container, upgrade_id);
        let spec = target
            .containers
            .iter()
            .chain(&target.init_containers)
            .find(|c| c.name == ch.container)
            .and_then(|c| c.readiness.as_ref());
        let old = match old {
            Some(c) => Some(seen(cri, c, None).await?),
            None => None,
        };
        let new = match new {
            Some(c) => {
                let ready = if c.state == api::ContainerState::ContainerRunning as i32 {
                    readiness.check(cri, &c.id, &ip, spec).await
                } else {
                    spec.map(|_| false)
                };
                Some(seen(cri, c, ready).await?)
            }
            None => None,
        };
        pairs.push(Pair {
            name: ch.container.clone(),
            old,
            new,
        });
    }
    Ok(Observed {
        missing_images: missing,
        pairs,
        sandbox_ready: now.sandbox.is_some(),
    })
}

async fn seen<R: CriRuntime>(
    cri: &R,
    c: &api::Container,
    ready: Option<bool>,
) -> Result<Seen, CriError> {
    let exit_code = if c.state == api::ContainerState::ContainerExited as i32 {
        match cri.container_status(&c.id).await {
            Ok(s) => s.map(|s| s.exit_code).unwrap_or(-1),
            Err(e) if e.is_not_found() => -1,
            Err(e) => return Err(e),
        }
    } else {
        0
    };
    Ok(Seen {
        id: c.id.clone(),
        state: run_of(c.state),
        ready,
        exit_code,
    })
}

/// Whether the target image is, by digest, the image the old container already runs: a tag
/// that moved to the same digest is no change.
pub async fn same_image<R: CriRuntime>(
    cri: &R,
    old: &api::Container,
    target_image: &str,
) -> Result<bool, CriError> {
    let Some(img) = cri.image_status(target_image).await? else {
        return Ok(false);
    };
    let old_ref = match cri.container_status(&old.id).await {
        Ok(Some(s)) => s.image_ref,
        Ok(None) => return Ok(false),
        Err(e) if e.is_not_found() => return Ok(false),
        Err(e) => return Err(e),
    };
    Ok(!old_ref.is_empty() && (img.id == old_ref || img.repo_digests.contains(&old_ref)))
}

/// Pulls an image with the credentials of the container that uses it.
pub async fn pull<R: CriRuntime>(cri: &R, image: &str, target: &PodPlan) -> Result<(), CriError> {
    let auth = target
        .containers
        .iter()
        .chain(&target.init_containers)
        .find(|c| c.image == image)
        .and_then(|c| c.auth.as_ref())
        .map(|a| api::AuthConfig {
            username: a.username.clone(),
            password: a.password.clone(),
            ..Default::default()
        });
    cri.pull_image(image, auth).await.map(|_| ())
}

/// Creates (does not start) the new container for `c` in the sandbox, labelled with the
/// upgrade id.
pub async fn create_new<R: CriRuntime>(
    cri: &R,
    now: &PodNow,
    target: &PodPlan,
    c: &ContainerPlan,
    upgrade_id: &str,
) -> Result<String, CriError> {
    let sb = now.ready_sandbox()?;
    let attempt = now.next_attempt(&c.name);
    let mut cfg = c.config.clone();
    if let Some(m) = cfg.metadata.as_mut() {
        m.attempt = attempt;
    }
    cfg.labels
        .insert(labels::UPGRADE_ID.to_string(), upgrade_id.to_string());
    cfg.log_path = format!("{}_{attempt}.log", c.name);
    let id = cri
        .create_container(&sb.id, cfg, target.sandbox.clone())
        .await?;
    tracing::info!(pod = %target.name, container = %c.name, id = %id, attempt, upgrade = %upgrade_id, "new container created");
    Ok(id)
}

/// Creates and starts a container from the old spec (a rollback), as the next attempt.
pub async fn restore<R: CriRuntime>(
    cri: &R,
    now: &PodNow,
    old: &PodPlan,
    c: &ContainerPlan,
) -> Result<String, CriError> {
    let sb = now.ready_sandbox()?;
    crate::runtime::act::create_and_start(
        cri,
        &old.name,
        &sb.id,
        &old.sandbox,
        c,
        now.next_attempt(&c.name),
    )
    .await
}

pub fn ignore_missing(r: Result<(), CriError>) -> Result<(), CriError> {
    match r {
        Err(e) if e.is_not_found() => Ok(()),
        other => other,
    }
}
