//! The upgrade's I/O: what the runtime shows of the pod (for the machine), and each step,
//! carried out against the CRI. Every step is idempotent: an object already gone counts as
//! removed, and a container is told old from new by the upgrade id label it carries.

use super::machine::{Observed, Pair, Pod as MPod, Run, Sandboxes, Seen, State, StopFirst};
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

/// What a round looks at besides the containers, by state: the images (Pulling), the new
/// containers' readiness (while they are verified), the restored old ones' (a rollback).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Look {
    pub images: bool,
    pub probe_new: bool,
    pub probe_old: bool,
}

impl Look {
    pub fn at(state: State) -> Look {
        Look {
            images: state == State::Pulling,
            probe_new: matches!(state, State::Swapping | State::Verifying),
            probe_old: state == State::RollingBack,
        }
    }
}

/// Where a plan's httpGet and tcpSocket probes go: the pod's address (the sandbox's on the pod
/// network, the node's with host network), as the runtime's probes do.
fn probe_ip(p: Option<&PodPlan>) -> String {
    p.and_then(|t| t.pod_ip.clone())
        .unwrap_or_else(|| "127.0.0.1".into())
}

fn readiness_of<'a>(p: Option<&'a PodPlan>, name: &str) -> Option<&'a ProbeSpec> {
    p?.containers
        .iter()
        .find(|c| c.name == name)
        .and_then(|c| c.readiness.as_ref())
}

/// A container seen with its readiness: probed (when `probe` and it runs), else unknown for
/// one without a probe, not ready for one with a probe that does not run.
async fn seen_probed<R: CriRuntime>(
    cri: &R,
    now: &PodNow,
    c: &api::Container,
    spec: Option<&ProbeSpec>,
    ip: &str,
    probe: bool,
    readiness: &mut Readiness,
) -> Seen {
    let ready = if !probe {
        None
    } else if c.state == api::ContainerState::ContainerRunning as i32 {
        readiness.check(cri, &c.id, ip, spec).await
    } else {
        spec.map(|_| false)
    };
    seen(now, c, ready)
}

/// What the machine needs: missing target images, and each changed container's old and new.
/// `target` (`old`) is `Err(why)` when the target (old) revision cannot be translated now;
/// then only what the other side needs is observed.
#[allow(clippy::too_many_arguments)]
pub async fn observe<R: CriRuntime>(
    cri: &R,
    now: &PodNow,
    plan: &UpgradePlan,
    target: Result<&PodPlan, &str>,
    old: Result<&PodPlan, &str>,
    upgrade_id: &str,
    look: Look,
    readiness: &mut Readiness,
) -> Result<Observed, CriError> {
    let mut missing = Vec::new();
    if look.images {
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
    let old_unavailable = old.err().map(str::to_string);
    let (target, old) = (target.ok(), old.ok());
    let mut o = if plan.mode == Mode::Recreate {
        observe_recreate(now, target, old, upgrade_id, missing, look, cri, readiness).await
    } else {
        let (ip, old_ip) = (probe_ip(target), probe_ip(old));
        let mut pairs = Vec::new();
        let mut inits = Vec::new();
        for ch in &plan.changes {
            let (was, new) = now.pair(&ch.container, upgrade_id);
            let was = match was {
                Some(c) if !ch.init => {
                    let spec = readiness_of(old, &ch.container);
                    Some(seen_probed(cri, now, c, spec, &old_ip, look.probe_old, readiness).await)
                }
                Some(c) => Some(seen(now, c, None)),
                None => None,
            };
            let new = match new {
                Some(c) if ch.init => Some(seen(now, c, None)),
                // Without the target's translation its probe is unknown: not verified.
                Some(c) if target.is_none() => Some(seen(now, c, Some(false))),
                Some(c) => {
                    let spec = readiness_of(target, &ch.container);
                    Some(seen_probed(cri, now, c, spec, &ip, look.probe_new, readiness).await)
                }
                None => None,
            };
            let p = Pair {
                name: ch.container.clone(),
                old: was,
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
            restore: Vec::new(),
        }
    };
    o.target_unavailable = target_unavailable;
    o.old_unavailable = old_unavailable;
    Ok(o)
}

/// What of the old pod must stop before the new sandbox starts: host ports on the pod network
/// are the old sandbox's port mappings (it stops); with host network its containers bind the
/// host's ports (they stop, the sandbox stays).
fn stop_first(old: Option<&PodPlan>, target: Option<&PodPlan>) -> StopFirst {
    let ports = |p: &PodPlan| p.sandbox.port_mappings.iter().any(|m| m.host_port > 0);
    let old_maps = old.is_some_and(|p| !p.host_network && ports(p));
    // Without the old translation, the target says as much as it can (it usually matches).
    let target_maps = old.is_none() && target.is_some_and(|p| !p.host_network && ports(p));
    if old_maps || target_maps {
        StopFirst::Sandbox
    } else if old
        .into_iter()
        .chain(target)
        .any(|p| p.host_network || ports(p))
    {
        StopFirst::Containers
    } else {
        StopFirst::Nothing
    }
}

/// The recreate path: the old sandbox and the new one, each target container's old and new
/// instance, and each old container's instance in the old sandbox (what a rollback restores).
#[allow(clippy::too_many_arguments)]
async fn observe_recreate<R: CriRuntime>(
    now: &PodNow,
    target: Option<&PodPlan>,
    old: Option<&PodPlan>,
    upgrade_id: &str,
    missing: Vec<String>,
    look: Look,
    cri: &R,
    readiness: &mut Readiness,
) -> Observed {
    let (old_sb, new_sb) = now.pods(upgrade_id);
    let (ip, old_ip) = (probe_ip(target), probe_ip(old));
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
        let was = old_sb
            .and_then(|sb| now.in_sandbox(&sb.id, &c.name))
            .map(|o| seen(now, o, None));
        let new = match new_sb.and_then(|sb| now.in_sandbox(&sb.id, &c.name)) {
            Some(n) => {
                let spec = c.readiness.as_ref();
                Some(seen_probed(cri, now, n, spec, &ip, look.probe_new, readiness).await)
            }
            None => None,
        };
        pairs.push(Pair {
            name: c.name.clone(),
            old: was,
            new,
        });
    }
    let mut restore = Vec::new();
    for c in old.map(|t| t.containers.as_slice()).unwrap_or(&[]) {
        let was = match old_sb.and_then(|sb| now.in_sandbox(&sb.id, &c.name)) {
            Some(o) => {
                let spec = c.readiness.as_ref();
                Some(seen_probed(cri, now, o, spec, &old_ip, look.probe_old, readiness).await)
            }
            None => None,
        };
        restore.push(Pair {
            name: c.name.clone(),
            old: was,
            new: None,
        });
    }
    let pod = |s: Option<&api::PodSandbox>| {
        s.map(|s| MPod {
            id: s.id.clone(),
            ready: is_ready(s),
            running: now
                .of_sandbox(&s.id)
                .any(|c| c.state == api::ContainerState::ContainerRunning as i32),
        })
    };
    Observed {
        missing_images: missing,
        pairs,
        sandbox_ready: new_sb.is_some_and(is_ready),
        recreate: Some(Sandboxes {
            old: pod(old_sb),
            new: pod(new_sb),
            stop_first: stop_first(old, target),
        }),
        inits,
        target_unavailable: None,
        old_unavailable: None,
        restore,
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

/// Stops a sandbox's containers (with the grace period), keeping them and the sandbox: a
/// rollback restores the old revision in it.
pub async fn stop_containers<R: CriRuntime>(
    cri: &R,
    now: &PodNow,
    sandbox_id: &str,
    grace_secs: i64,
) -> Result<(), CriError> {
    let running: Vec<String> = now
        .of_sandbox(sandbox_id)
        .filter(|c| c.state == api::ContainerState::ContainerRunning as i32)
        .map(|c| c.id.clone())
        .collect();
    crate::pod::start::stop_all(cri, &running, grace_secs).await
}

/// A step that failed: the runtime, or what the step was given.
#[derive(Debug, thiserror::Error)]
pub enum StepFailure {
    #[error(transparent)]
    Cri(#[from] CriError),
    #[error("{0}")]
    Other(String),
}
