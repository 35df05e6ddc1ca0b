//! The upgrade's I/O: what the runtime shows of the pod (for the machine), and each step,
//! carried out against the CRI. Every step is idempotent: an object already gone counts as
//! removed, and a container is told old from new by the upgrade id label it carries.

use super::machine::{Observed, Pair, Pod as MPod, Run, Sandboxes, Seen};
use super::plan::{Mode, UpgradePlan};
use crate::cri::{api, labels, CriError, CriRuntime};
use crate::pod::observe::{
    attempt_of, attempt_of_sandbox, is_named, is_ready, ContainerFacts, Observer, PodObserved,
    Snapshot,
};
use crate::pod::probes::{self, ProbeSpec, ProbeState};
use crate::pod::start::ignore_missing;
use crate::podspec::{ContainerPlan, PodPlan};
use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

/// The pod's sandboxes and containers, as the runtime shows them now: one snapshot of the
/// runtime's own observer ([`Observer`]), so the engine and the runtime can never disagree on
/// what runs (the sandbox's address, a container's exit code).
#[derive(Debug, Clone)]
pub struct PodNow {
    snap: Snapshot,
    uid: String,
}

fn of_upgrade(l: &HashMap<String, String>, id: &str) -> bool {
    l.get(labels::UPGRADE_ID).map(String::as_str) == Some(id)
}

/// Reads the runtime once, through the observer (which remembers what does not change), and
/// keeps what belongs to pod `uid`: objects labelled with its uid or with a pod it adopted.
pub async fn pod_now<R: CriRuntime>(
    observer: &mut Observer,
    cri: &R,
    node: &str,
    pods_dir: &Path,
    uid: &str,
    aliases: HashMap<String, String>,
) -> Result<PodNow, CriError> {
    let mut snap = observer.observe(cri, node, pods_dir).await?;
    snap.apply_aliases(aliases);
    Ok(PodNow {
        snap,
        uid: uid.to_string(),
    })
}

impl PodNow {
    fn obs(&self) -> PodObserved<'_> {
        self.snap.pod(&self.uid)
    }

    /// The ready sandbox with the highest attempt: where an in-place swap happens.
    pub fn sandbox(&self) -> Option<&api::PodSandbox> {
        self.obs().ready_sandbox()
    }

    /// The ready sandbox to create containers in.
    fn ready_sandbox(&self) -> Result<&api::PodSandbox, CriError> {
        self.sandbox().ok_or_else(|| CriError::Call {
            method: "CreateContainer",
            code: "NoSandbox".into(),
            message: "the pod has no ready sandbox".into(),
        })
    }

    /// The pod-network address of sandbox `sb`, if it has one.
    pub fn sandbox_ip(&self, sb: &str) -> Option<&str> {
        self.obs().sandbox_ip(sb)
    }

    /// What the runtime said of container `id` beyond the list (exit code, image digest).
    pub fn facts(&self, id: &str) -> Option<&ContainerFacts> {
        self.obs().facts(id)
    }

    /// The containers of the ready sandbox.
    fn containers(&self) -> impl Iterator<Item = &api::Container> {
        let sb = self.sandbox().map(|s| s.id.clone()).unwrap_or_default();
        self.obs()
            .containers()
            .filter(move |c| !sb.is_empty() && c.pod_sandbox_id == sb)
    }

    /// The next attempt number for container `name` in the ready sandbox.
    pub fn next_attempt(&self, name: &str) -> u32 {
        self.containers()
            .filter(|c| is_named(c, name))
            .map(|c| attempt_of(c) + 1)
            .max()
            .unwrap_or(0)
    }

    /// The next attempt number for container `name` counting every sandbox of the pod: the
    /// runtime reserves a container's name (which includes its attempt) until it is removed.
    pub fn next_attempt_anywhere(&self, name: &str) -> u32 {
        self.obs()
            .containers()
            .filter(|c| is_named(c, name))
            .map(|c| attempt_of(c) + 1)
            .max()
            .unwrap_or(0)
    }

    /// The attempt number for the pod's next sandbox.
    pub fn next_sandbox_attempt(&self) -> u32 {
        self.obs().next_sandbox_attempt()
    }

    /// In place: the newest container of `name` this upgrade made, and the newest other one.
    pub fn pair(
        &self,
        name: &str,
        upgrade_id: &str,
    ) -> (Option<&api::Container>, Option<&api::Container>) {
        let newest = |new: bool| {
            self.containers()
                .filter(|c| is_named(c, name) && of_upgrade(&c.labels, upgrade_id) == new)
                .max_by_key(|c| attempt_of(c))
        };
        (newest(false), newest(true))
    }

    /// Recreate: the newest sandbox this upgrade made, and the newest other one.
    pub fn pods(&self, upgrade_id: &str) -> (Option<&api::PodSandbox>, Option<&api::PodSandbox>) {
        let newest = |new: bool| {
            self.obs()
                .sandboxes()
                .filter(|s| of_upgrade(&s.labels, upgrade_id) == new)
                .max_by_key(|s| attempt_of_sandbox(s))
        };
        (newest(false), newest(true))
    }

    /// The newest container of `name` in sandbox `sb`.
    pub fn in_sandbox(&self, sb: &str, name: &str) -> Option<&api::Container> {
        self.obs()
            .containers()
            .filter(|c| c.pod_sandbox_id == sb && is_named(c, name))
            .max_by_key(|c| attempt_of(c))
    }

    /// The containers of sandbox `sb`.
    pub fn of_sandbox<'a>(&'a self, sb: &'a str) -> impl Iterator<Item = &'a api::Container> {
        self.obs()
            .containers()
            .filter(move |c| c.pod_sandbox_id == sb)
    }

    /// Recreate: the new sandbox's pod-network address, for the containers' `status.podIP`.
    pub fn new_pod_ip(&self, upgrade_id: &str) -> Option<String> {
        let sb = self.pods(upgrade_id).1?;
        self.sandbox_ip(&sb.id).map(str::to_string)
    }
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
            tracing::debug!(container = id, ip, outcome = ?outcome, "readiness probe of a new container");
            let sp = sp.clone();
            st.record(Instant::now(), outcome, &sp);
        }
        Some(st.verdict == Some(true))
    }
}

/// What the machine needs: missing target images, and each changed container's old and new.
/// `target` is `Err(why)` when the target revision cannot be translated now; then only what
/// a rollback needs is observed.
#[allow(clippy::too_many_arguments)]
pub async fn observe<R: CriRuntime>(
    cri: &R,
    now: &PodNow,
    plan: &UpgradePlan,
    target: Result<&PodPlan, &str>,
    old_unavailable: Option<String>,
    upgrade_id: &str,
    check_images: bool,
    readiness: &mut Readiness,
) -> Result<Observed, CriError> {
    let mut missing = Vec::new();
    if check_images {
        let wanted: Vec<&String> = match (&plan.mode, target) {
            (Mode::InPlace, _) => plan.changes.iter().map(|c| &c.to).collect(),
            (Mode::Recreate, Ok(t)) => t
                .containers
                .iter()
                .chain(&t.init_containers)
                .map(|c| &c.image)
                .collect(),
            (Mode::Recreate, Err(_)) => Vec::new(),
        };
        for img in wanted {
            if cri.image_status(img).await?.is_none() && !missing.contains(img) {
                missing.push(img.clone());
            }
        }
    }
    let target_unavailable = target.err().map(str::to_string);
    let target = target.ok();
    // Where httpGet and tcpSocket probes go: the pod's address (the sandbox's on the pod
    // network, the node's with host network), as the runtime's probes do.
    let ip = target
        .and_then(|t| t.pod_ip.clone())
        .unwrap_or_else(|| "127.0.0.1".into());
    let mut o = if plan.mode == Mode::Recreate {
        observe_recreate(now, target, upgrade_id, missing, &ip, cri, readiness).await
    } else {
        let spec_of = |name: &str| {
            target.and_then(|t| {
                t.containers
                    .iter()
                    .find(|c| c.name == name)
                    .and_then(|c| c.readiness.as_ref())
            })
        };
        let mut pairs = Vec::new();
        let mut inits = Vec::new();
        for ch in &plan.changes {
            let (old, new) = now.pair(&ch.container, upgrade_id);
            let old = old.map(|c| seen(now, c, None));
            let new = match new {
                Some(c) if ch.init => Some(seen(now, c, None)),
                // Without the target's translation its probe is unknown: not verified.
                Some(c) if target.is_none() => Some(seen(now, c, Some(false))),
                Some(c) => {
                    let spec = spec_of(&ch.container);
                    let ready = if c.state == api::ContainerState::ContainerRunning as i32 {
                        readiness.check(cri, &c.id, &ip, spec).await
                    } else {
                        spec.map(|_| false)
                    };
                    Some(seen(now, c, ready))
                }
                None => None,
            };
            let p = Pair {
                name: ch.container.clone(),
                old,
                new,
            };
            if ch.init {
                inits.push(p);
            } else {
                pairs.push(p);
            }
        }
        Observed {
            missing_images: missing,
            pairs,
            sandbox_ready: now.sandbox().is_some(),
            recreate: None,
            inits,
            target_unavailable: None,
            old_unavailable: None,
        }
    };
    o.target_unavailable = target_unavailable;
    o.old_unavailable = old_unavailable;
    Ok(o)
}

/// The recreate path: the old sandbox and the new one, and each target container's old and
/// new instance.
async fn observe_recreate<R: CriRuntime>(
    now: &PodNow,
    target: Option<&PodPlan>,
    upgrade_id: &str,
    missing: Vec<String>,
    ip: &str,
    cri: &R,
    readiness: &mut Readiness,
) -> Observed {
    let (old_sb, new_sb) = now.pods(upgrade_id);
    let mut inits = Vec::new();
    let mut pairs = Vec::new();
    for c in target.map(|t| t.init_containers.as_slice()).unwrap_or(&[]) {
        let new = new_sb
            .and_then(|sb| now.in_sandbox(&sb.id, &c.name))
            .map(|n| seen(now, n, None));
        inits.push(Pair {
            name: c.name.clone(),
            old: None,
            new,
        });
    }
    for c in target.map(|t| t.containers.as_slice()).unwrap_or(&[]) {
        let old = old_sb
            .and_then(|sb| now.in_sandbox(&sb.id, &c.name))
            .map(|o| seen(now, o, None));
        let new = match new_sb.and_then(|sb| now.in_sandbox(&sb.id, &c.name)) {
            Some(n) => {
                let r = if n.state == api::ContainerState::ContainerRunning as i32 {
                    readiness.check(cri, &n.id, ip, c.readiness.as_ref()).await
                } else {
                    c.readiness.as_ref().map(|_| false)
                };
                Some(seen(now, n, r))
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
            ready: is_ready(s),
        })
    };
    let stop_first = target
        .is_some_and(|t| t.host_network || t.sandbox.port_mappings.iter().any(|p| p.host_port > 0));
    Observed {
        missing_images: missing,
        pairs,
        sandbox_ready: new_sb.is_some_and(is_ready),
        recreate: Some(Sandboxes {
            old: pod(old_sb),
            new: pod(new_sb),
            stop_first,
        }),
        inits,
        target_unavailable: None,
        old_unavailable: None,
    }
}

/// A container as the machine sees it; its exit code from the observer's facts.
fn seen(now: &PodNow, c: &api::Container, ready: Option<bool>) -> Seen {
    let exit_code = if c.state == api::ContainerState::ContainerExited as i32 {
        now.facts(&c.id).map(|f| f.exit_code).unwrap_or(-1)
    } else {
        0
    };
    Seen {
        id: c.id.clone(),
        state: run_of(c.state),
        ready,
        exit_code,
    }
}

/// Whether the target image is, by digest, the image the old container already runs: a tag
/// that moved to the same digest is no change.
pub async fn same_image<R: CriRuntime>(
    cri: &R,
    now: &PodNow,
    old: &api::Container,
    target_image: &str,
) -> Result<bool, CriError> {
    let Some(img) = cri.image_status(target_image).await? else {
        return Ok(false);
    };
    let old_ref = now
        .facts(&old.id)
        .map(|f| f.image_ref.as_str())
        .unwrap_or("");
    Ok(!old_ref.is_empty() && (img.id == old_ref || img.repo_digests.iter().any(|d| d == old_ref)))
}

/// Pulls an image with the credentials of the container that uses it.
pub async fn pull<R: CriRuntime>(cri: &R, image: &str, target: &PodPlan) -> Result<(), CriError> {
    let auth = target
        .containers
        .iter()
        .chain(&target.init_containers)
        .find(|c| c.image == image)
        .and_then(crate::pod::start::pull_auth);
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
    let mut cfg = crate::pod::start::attempt_config(c, attempt)?;
    cfg.labels
        .insert(labels::UPGRADE_ID.to_string(), upgrade_id.to_string());
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
    crate::pod::start::create_and_start(
        cri,
        &old.name,
        &sb.id,
        &old.sandbox,
        c,
        now.next_attempt(&c.name),
    )
    .await
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
