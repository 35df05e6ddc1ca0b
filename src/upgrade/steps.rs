//! The upgrade's I/O: what the runtime shows of the pod (for the machine), and each step,
//! carried out against the CRI. Every step is idempotent: an object already gone counts as
//! removed, and a container is told old from new by the upgrade id label it carries.

use super::machine::{Observed, Pair, Pod as MPod, Run, Sandboxes, Seen};
use super::plan::{Mode, UpgradePlan};
use crate::cri::{api, labels, CriError, CriRuntime};
use crate::podspec::{ContainerPlan, PodPlan};
use crate::runtime::probes::{self, ProbeSpec, ProbeState};
use std::collections::HashMap;
use std::time::Instant;

/// The pod's sandboxes and containers, as the runtime shows them now.
#[derive(Debug, Clone, Default)]
pub struct PodNow {
    /// The ready sandbox with the highest attempt: where an in-place swap happens.
    pub sandbox: Option<api::PodSandbox>,
    /// Every sandbox of the pod.
    pub sandboxes: Vec<api::PodSandbox>,
    /// Every container of the pod, in any sandbox.
    pub all: Vec<api::Container>,
    /// The containers of `sandbox`.
    pub containers: Vec<api::Container>,
}

fn attempt(c: &api::Container) -> u32 {
    c.metadata.as_ref().map(|m| m.attempt).unwrap_or(0)
}

fn sandbox_attempt(s: &api::PodSandbox) -> u32 {
    s.metadata.as_ref().map(|m| m.attempt).unwrap_or(0)
}

fn named(c: &api::Container, name: &str) -> bool {
    c.labels.get(labels::CONTAINER_NAME).map(String::as_str) == Some(name)
}

fn of_upgrade(l: &HashMap<String, String>, id: &str) -> bool {
    l.get(labels::UPGRADE_ID).map(String::as_str) == Some(id)
}

fn ready(s: &api::PodSandbox) -> bool {
    s.state == api::PodSandboxState::SandboxReady as i32
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

    /// The next attempt number for container `name` counting every sandbox of the pod: the
    /// runtime reserves a container's name (which includes its attempt) until it is removed.
    pub fn next_attempt_anywhere(&self, name: &str) -> u32 {
        self.all
            .iter()
            .filter(|c| named(c, name))
            .map(|c| attempt(c) + 1)
            .max()
            .unwrap_or(0)
    }

    /// The attempt number for the pod's next sandbox.
    pub fn next_sandbox_attempt(&self) -> u32 {
        self.sandboxes
            .iter()
            .map(|s| sandbox_attempt(s) + 1)
            .max()
            .unwrap_or(0)
    }

    /// In place: the newest container of `name` this upgrade made, and the newest other one.
    pub fn pair(
        &self,
        name: &str,
        upgrade_id: &str,
    ) -> (Option<&api::Container>, Option<&api::Container>) {
        let newest = |new: bool| {
            self.containers
                .iter()
                .filter(|c| named(c, name) && of_upgrade(&c.labels, upgrade_id) == new)
                .max_by_key(|c| attempt(c))
        };
        (newest(false), newest(true))
    }

    /// Recreate: the newest sandbox this upgrade made, and the newest other one.
    pub fn pods(&self, upgrade_id: &str) -> (Option<&api::PodSandbox>, Option<&api::PodSandbox>) {
        let newest = |new: bool| {
            self.sandboxes
                .iter()
                .filter(|s| of_upgrade(&s.labels, upgrade_id) == new)
                .max_by_key(|s| sandbox_attempt(s))
        };
        (newest(false), newest(true))
    }

    /// The newest container of `name` in sandbox `sb`.
    pub fn in_sandbox(&self, sb: &str, name: &str) -> Option<&api::Container> {
        self.all
            .iter()
            .filter(|c| c.pod_sandbox_id == sb && named(c, name))
            .max_by_key(|c| attempt(c))
    }

    /// The containers of sandbox `sb`.
    pub fn of_sandbox<'a>(&'a self, sb: &'a str) -> impl Iterator<Item = &'a api::Container> {
        self.all.iter().filter(move |c| c.pod_sandbox_id == sb)
    }
}

/// Reads the pod's sandboxes and containers: those labelled with its uid, and those of a pod
/// it adopted (`aliases`: label uid -> pod uid).
pub async fn pod_now<R: CriRuntime>(
    cri: &R,
    uid: &str,
    node: &str,
    aliases: &HashMap<String, String>,
) -> Result<PodNow, CriError> {
    let sel = HashMap::from([(labels::NODE.to_string(), node.to_string())]);
    let owner = |l: &HashMap<String, String>| {
        l.get(labels::POD_UID)
            .map(|u| aliases.get(u).unwrap_or(u).as_str() == uid)
            .unwrap_or(false)
    };
    let sandboxes: Vec<api::PodSandbox> = cri
        .list_pod_sandbox(sel.clone())
        .await?
        .into_iter()
        .filter(|s| owner(&s.labels))
        .collect();
    let all: Vec<api::Container> = cri
        .list_containers(sel)
        .await?
        .into_iter()
        .filter(|c| owner(&c.labels))
        .collect();
    let sandbox = sandboxes
        .iter()
        .filter(|s| ready(s))
        .max_by_key(|s| sandbox_attempt(s))
        .cloned();
    let containers = match &sandbox {
        Some(sb) => all
            .iter()
            .filter(|c| c.pod_sandbox_id == sb.id)
            .cloned()
            .collect(),
        None => Vec::new(),
    };
    Ok(PodNow {
        sandbox,
        sandboxes,
        all,
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
        let wanted: Vec<&String> = match plan.mode {
            Mode::InPlace => plan.changes.iter().map(|c| &c.to).collect(),
            Mode::Recreate => target
                .containers
                .iter()
                .chain(&target.init_containers)
                .map(|c| &c.image)
                .collect(),
        };
        for img in wanted {
            if cri.image_status(img).await?.is_none() && !missing.contains(img) {
                missing.push(img.clone());
            }
        }
    }
    let ip = target.pod_ip.clone().unwrap_or_else(|| "127.0.0.1".into());
    if plan.mode == Mode::Recreate {
        return observe_recreate(cri, now, target, upgrade_id, missing, &ip, readiness).await;
    }
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
        recreate: None,
        inits: Vec::new(),
    })
}

/// The recreate path: the old sandbox and the new one, and each target container's old and
/// new instance.
async fn observe_recreate<R: CriRuntime>(
    cri: &R,
    now: &PodNow,
    target: &PodPlan,
    upgrade_id: &str,
    missing: Vec<String>,
    ip: &str,
    readiness: &mut Readiness,
) -> Result<Observed, CriError> {
    let (old_sb, new_sb) = now.pods(upgrade_id);
    let mut inits = Vec::new();
    for c in &target.init_containers {
        let new = match new_sb.and_then(|sb| now.in_sandbox(&sb.id, &c.name)) {
            Some(n) => Some(seen(cri, n, None).await?),
            None => None,
        };
        inits.push(Pair {
            name: c.name.clone(),
            old: None,
            new,
        });
    }
    let mut pairs = Vec::new();
    for c in &target.containers {
        let old = match old_sb.and_then(|sb| now.in_sandbox(&sb.id, &c.name)) {
            Some(o) => Some(seen(cri, o, None).await?),
            None => None,
        };
        let new = match new_sb.and_then(|sb| now.in_sandbox(&sb.id, &c.name)) {
            Some(n) => {
                let r = if n.state == api::ContainerState::ContainerRunning as i32 {
                    readiness.check(cri, &n.id, ip, c.readiness.as_ref()).await
                } else {
                    c.readiness.as_ref().map(|_| false)
                };
                Some(seen(cri, n, r).await?)
            }
            None => None,
        };
        pairs.push(Pair {
            name: c.name.clone(),
            old,
            new,
        });
    }
    let pod = |s: Option<&api::PodSandbox>| {
        s.map(|s| MPod {
            id: s.id.clone(),
            ready: ready(s),
        })
    };
    let stop_first =
        target.host_network || target.sandbox.port_mappings.iter().any(|p| p.host_port > 0);
    Ok(Observed {
        missing_images: missing,
        pairs,
        sandbox_ready: new_sb.is_some_and(ready),
        recreate: Some(Sandboxes {
            old: pod(old_sb),
            new: pod(new_sb),
            stop_first,
        }),
        inits,
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
    let recreate = now
        .pods(upgrade_id)
        .1
        .filter(|s| s.labels.contains_key(labels::UPGRADE_ID));
    let sb = match recreate {
        Some(s) => s,
        None => now.ready_sandbox()?,
    };
    let attempt = if recreate.is_some() {
        now.next_attempt_anywhere(&c.name)
    } else {
        now.next_attempt(&c.name)
    };
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

/// Recreate: prepares the target's volumes and runs the new sandbox (labelled with the upgrade
/// id, the pod's next attempt). Its containers are created step by step, init containers
/// first.
pub async fn create_pod<R: CriRuntime>(
    cri: &R,
    now: &PodNow,
    target_json: &serde_json::Value,
    mut ctx: crate::podspec::PodContext,
    upgrade_id: &str,
) -> Result<(), StepFailure> {
    ctx.attempt = now.next_sandbox_attempt();
    let plan = crate::podspec::translate(target_json, &ctx)
        .map_err(|e| StepFailure::Other(e.to_string()))?;
    crate::volumes::prepare(&plan, &ctx).map_err(|e| StepFailure::Other(e.to_string()))?;
    let mut cfg = plan.sandbox.clone();
    cfg.labels
        .insert(labels::UPGRADE_ID.to_string(), upgrade_id.to_string());
    let id = cri.run_pod_sandbox(cfg).await?;
    tracing::info!(pod = %plan.name, sandbox = %id, upgrade = %upgrade_id, "new sandbox started");
    Ok(())
}

/// Recreate: the new sandbox's pod-network address, for the containers' `status.podIP`.
pub async fn new_pod_ip<R: CriRuntime>(
    cri: &R,
    now: &PodNow,
    upgrade_id: &str,
) -> Result<Option<String>, CriError> {
    let Some(sb) = now.pods(upgrade_id).1 else {
        return Ok(None);
    };
    match cri.pod_sandbox_status(&sb.id).await {
        Ok(st) => Ok(st
            .and_then(|s| s.network)
            .map(|n| n.ip)
            .filter(|ip| !ip.is_empty())),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e),
    }
}

/// Stops a sandbox's containers (with the grace period) and the sandbox; with `remove`, removes
/// them too.
pub async fn stop_pod<R: CriRuntime>(
    cri: &R,
    now: &PodNow,
    sandbox_id: &str,
    grace_secs: i64,
    remove: bool,
) -> Result<(), CriError> {
    for c in now.of_sandbox(sandbox_id) {
        ignore_missing(cri.stop_container(&c.id, grace_secs).await)?;
        if remove {
            ignore_missing(cri.remove_container(&c.id).await)?;
        }
    }
    ignore_missing(cri.stop_pod_sandbox(sandbox_id).await)?;
    if remove {
        ignore_missing(cri.remove_pod_sandbox(sandbox_id).await)?;
    }
    Ok(())
}

/// A step that failed: the runtime, or what the step was given.
#[derive(Debug, thiserror::Error)]
pub enum StepFailure {
    #[error(transparent)]
    Cri(#[from] CriError),
    #[error("{0}")]
    Other(String),
}
