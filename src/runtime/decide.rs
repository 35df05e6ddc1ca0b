//! The pod runtime's decision, pure: from the desired pods (the cache), one snapshot of the
//! container runtime, what the runtime remembers (backoffs, probes, volumes written), the pods
//! it must leave alone, and the time, to the list of [`Action`]s that close the gap.
//!
//! Nothing here does I/O, so every rule is unit-tested with plain values:
//! - a pod without a ready sandbox is started (its old sandboxes removed first);
//! - init containers run one at a time, each to success, before the app containers;
//! - an exited container waits out its crash-loop backoff, then gets the next attempt; a
//!   container that had run for [`BACKOFF_RESET_AFTER`] starts its backoff over;
//! - a running container whose liveness probe failed is stopped (and then restarted);
//! - a sandbox whose pod left the cache is stopped and removed, but only once the cache is
//!   trusted (sources ready): an empty or half-built cache stops nothing;
//! - a pod deleted in the cloud is stopped within its grace period, then finalized;
//! - pods held by someone else (an action in flight, the upgrade engine) get nothing.

use crate::backoff::BackoffPolicy;
use crate::cri::{api, labels};
use crate::pod::desired::DesiredPod;
use crate::pod::observe::{attempt_of, ContainerFacts, Snapshot};
use crate::pod::probes::ProbeSpec;
use crate::pod::probes::{ContainerProbes, ProbeKind};
use crate::podspec::{ContainerPlan, PlanError, PodContext, PodPlan, RestartPolicy, VolumePlan};
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

/// A container that ran this long before it exited starts its crash-loop backoff over, as the
/// kubelet's does.
pub const BACKOFF_RESET_AFTER: Duration = Duration::from_secs(600);

/// Crash-loop bookkeeping of one container (or, for refused pods, one pod).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Restarts {
    pub count: u32,
    pub next_allowed: Option<Instant>,
    /// The exited container this wait is for: a new exit starts a new wait.
    pub exited: Option<String>,
}

/// What the runtime remembers between passes.
#[derive(Debug, Clone, Copy)]
pub struct Memory<'a> {
    /// By (pod uid, container name).
    pub restarts: &'a HashMap<(String, String), Restarts>,
    /// Pods the runtime or the host refused, by uid: retried after their backoff.
    pub refused: &'a HashMap<String, Restarts>,
    /// By (pod uid, container name).
    pub probes: &'a HashMap<(String, String), ContainerProbes>,
    /// The digest of each pod's file volumes as last written, by uid.
    pub volumes: &'a HashMap<String, u64>,
}

/// A sandbox whose pod object edgehub deleted after an offline upgrade, so the DaemonSet
/// controller replaces it at the revision it already runs: the replacement adopts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Awaiting {
    /// The uid its CRI objects are labelled with.
    pub label_uid: String,
    pub namespace: String,
    pub owner_uid: String,
    pub hash: String,
    /// No replacement came in time: its sandbox is stopped.
    pub expired: bool,
}

/// Everything one decision looks at.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    pub desired: &'a [DesiredPod],
    pub snapshot: &'a Snapshot,
    pub memory: Memory<'a>,
    /// Pods that get no action: one is in flight for them, or the upgrade engine owns them.
    pub held: &'a HashSet<String>,
    /// The pod list has completed since the cache was created: the cache may say what must
    /// not run.
    pub sources_ready: bool,
    pub policy: BackoffPolicy,
    pub now: Instant,
    /// Sandboxes awaiting their replacement pod (delete-and-adopt).
    pub awaiting: &'a [Awaiting],
    /// Uids of upgrades that ended without committing (RolledBack, Failed): what they
    /// created is left over, whatever the engine managed to remove.
    pub ended_upgrades: &'a HashSet<String>,
}

/// What to start a pod with: its sandbox, volumes and first containers.
#[derive(Debug, Clone)]
pub struct StartSpec {
    pub raw: String,
    pub ctx: PodContext,
    pub plan: PodPlan,
}

/// One step for the runtime. Every action names its pod; the actions of one pod run in order,
/// and different pods' actions run concurrently.
#[derive(Debug, Clone)]
pub enum Action {
    /// Remove the pod's old sandboxes (with their containers), prepare its volumes, run a new
    /// sandbox, then create and start its first containers.
    StartPod {
        uid: String,
        remove_sandboxes: Vec<String>,
        remove_containers: Vec<String>,
        spec: Box<StartSpec>,
    },
    /// Rewrite the file volumes of a running pod (a renewed token, an edited ConfigMap).
    RefreshVolumes {
        uid: String,
        plan: Box<PodPlan>,
        digest: u64,
    },
    /// Create and start a container (pulling its image per policy), after removing the
    /// attempt it replaces.
    CreateContainer {
        uid: String,
        pod: String,
        sandbox_id: String,
        container: Box<ContainerPlan>,
        sandbox_config: Box<api::PodSandboxConfig>,
        attempt: u32,
        replace: Option<String>,
    },
    /// Start a container that was created but not started (a crash between the two).
    StartCreated { uid: String, container_id: String },
    /// A container exited: remember its crash-loop wait (no runtime call).
    WaitRestart {
        uid: String,
        container: String,
        restarts: Restarts,
    },
    /// Stop a running container whose liveness probe failed.
    StopContainer {
        uid: String,
        container: String,
        container_id: String,
        grace_secs: i64,
        why: String,
    },
    Probe {
        uid: String,
        container: String,
        container_id: String,
        kind: ProbeKind,
        spec: ProbeSpec,
        /// Where httpGet and tcpSocket go when the probe names no host.
        ip: String,
    },
    /// Stop and remove what an upgrade that did not commit left in a running pod, and the
    /// older of two ready sandboxes: after it, the pod runs one revision in one sandbox.
    RemoveLeftovers {
        uid: String,
        sandboxes: Vec<String>,
        containers: Vec<String>,
        grace_secs: i64,
    },
    /// Stop and remove sandboxes and their containers.
    KillPod {
        uid: String,
        sandboxes: Vec<String>,
        containers: Vec<String>,
        grace_secs: i64,
    },
    /// Finish a pod's deletion on the apiserver (grace 0, uid precondition).
    Finalize {
        uid: String,
        namespace: String,
        name: String,
    },
    /// Remove `<data_dir>/pods/<uid>` (Secrets, tokens, logs) of a pod that is gone.
    RemovePodDir { uid: String },
    /// A replacement pod adopts the running sandbox of the pod it replaced (no runtime call):
    /// nothing restarts.
    Adopt { label_uid: String, uid: String },
    /// No replacement arrived in time: forget the wait (no runtime call); the sandbox is then
    /// stopped as any other unknown one.
    GiveUpAdoption { uid: String },
    /// The pod cannot run yet or at all: report why (no runtime call).
    Blocked {
        uid: String,
        reason: &'static str,
        message: String,
        /// A Warning Event is worth it (not for a source that is merely on its way).
        warn: bool,
        error: PlanError,
    },
}

impl Action {
    pub fn uid(&self) -> &str {
        match self {
            Action::StartPod { uid, .. }
            | Action::RefreshVolumes { uid, .. }
            | Action::CreateContainer { uid, .. }
            | Action::StartCreated { uid, .. }
            | Action::WaitRestart { uid, .. }
            | Action::StopContainer { uid, .. }
            | Action::Probe { uid, .. }
            | Action::KillPod { uid, .. }
            | Action::RemoveLeftovers { uid, .. }
            | Action::Finalize { uid, .. }
            | Action::RemovePodDir { uid }
            | Action::Adopt { uid, .. }
            | Action::GiveUpAdoption { uid }
            | Action::Blocked { uid, .. } => uid,
        }
    }

    /// Whether the action is carried out by a task (runtime or apiserver calls, disk), rather
    /// than by updating the runtime's memory.
    pub fn is_io(&self) -> bool {
        !matches!(
            self,
            Action::WaitRestart { .. }
                | Action::Blocked { .. }
                | Action::Adopt { .. }
                | Action::GiveUpAdoption { .. }
        )
    }
}

/// The containers a new sandbox starts with: the first init container, or every app container.
pub fn first_containers(plan: &PodPlan) -> Vec<&ContainerPlan> {
    match plan.init_containers.first() {
        Some(ic) => vec![ic],
        None => plan.containers.iter().collect(),
    }
}

/// A digest of a plan's file volumes: when it changes, they are rewritten.
pub fn volumes_digest(plan: &PodPlan) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for v in &plan.volumes {
        if let VolumePlan::Files { path, files, .. } = v {
            path.hash(&mut h);
            files.hash(&mut h);
        }
    }
    h.finish()
}

/// The whole decision.
pub fn decide(inp: &Inputs<'_>) -> Vec<Action> {
    let mut out = Vec::new();
    for pod in inp.desired {
        if inp.held.contains(pod.uid()) || pod.obj.index.deleting {
            continue;
        }
        // Leftovers first, alone: until they are gone, what the pod runs is not what its
        // spec says (a failed upgrade's container is the newest attempt of its name).
        if let Some(l) = leftovers(inp, pod.uid(), pod.grace_secs) {
            out.push(l);
            continue;
        }
        match &pod.plan {
            None => {}
            Some(Err(e)) => out.push(blocked(pod, e)),
            Some(Ok(plan)) => decide_pod(inp, pod, plan, &mut out),
        }
    }
    // Only once the pod object is gone: a deletion that never reached the apiserver (the
    // link fell between the mark and the request) leaves the pod as it was, to ask again.
    let cached: HashSet<&str> = inp.desired.iter().map(|p| p.uid()).collect();
    for a in inp.awaiting.iter().filter(|a| {
        !cached.contains(a.label_uid.as_str()) && (a.expired || replaced_elsewhere(inp, a))
    }) {
        out.push(Action::GiveUpAdoption {
            uid: a.label_uid.clone(),
        });
    }
    gone(inp, &mut out);
    out
}

/// What must go before pod `uid` runs one revision in one sandbox: the sandboxes and
/// containers of upgrades that ended without committing, and every ready sandbox but the
/// newest (the kubelet reconciles more than one ready sandbox too).
fn leftovers(inp: &Inputs<'_>, uid: &str, grace_secs: i64) -> Option<Action> {
    let obs = inp.snapshot.pod(uid);
    let ended = |l: &HashMap<String, String>| {
        l.get(labels::UPGRADE_ID)
            .is_some_and(|u| inp.ended_upgrades.contains(u))
    };
    let newest_ready = obs.ready_sandbox().map(|s| s.id.as_str());
    let mut sandboxes: Vec<String> = obs
        .sandboxes()
        .filter(|s| {
            ended(&s.labels)
                || (s.state == api::PodSandboxState::SandboxReady as i32
                    && Some(s.id.as_str()) != newest_ready)
        })
        .map(|s| s.id.clone())
        .collect();
    // A failed upgrade's sandbox may be the newest ready one: then the one before it stays.
    if newest_ready.is_some_and(|n| sandboxes.iter().any(|s| s == n)) {
        let keep = obs
            .sandboxes()
            .filter(|s| s.state == api::PodSandboxState::SandboxReady as i32 && !ended(&s.labels))
            .max_by_key(|s| s.metadata.as_ref().map(|m| m.attempt).unwrap_or(0))
            .map(|s| s.id.clone());
        sandboxes.retain(|s| Some(s) != keep.as_ref());
    }
    let containers: Vec<String> = obs
        .containers()
        .filter(|c| ended(&c.labels) || sandboxes.contains(&c.pod_sandbox_id))
        .map(|c| c.id.clone())
        .collect();
    if sandboxes.is_empty() && containers.is_empty() {
        return None;
    }
    Some(Action::RemoveLeftovers {
        uid: uid.to_string(),
        sandboxes,
        containers,
        grace_secs,
    })
}

/// Whether the DaemonSet controller's replacement is here at another revision (the DaemonSet
/// moved on after the DELETE): it can never adopt the awaiting sandbox, which would otherwise
/// run beside it, a second revision, until the adopt timeout.
fn replaced_elsewhere(inp: &Inputs<'_>, a: &Awaiting) -> bool {
    inp.desired.iter().any(|p| {
        let ix = &p.obj.index;
        ix.uid != a.label_uid
            && !ix.deleting
            && ix.namespace == a.namespace
            && ix.owner_uid.as_deref() == Some(a.owner_uid.as_str())
            && ix.revision_hash.as_deref() != Some(a.hash.as_str())
    })
}

/// The sandbox a new pod should adopt instead of starting its own: one awaiting its
/// replacement, of the same DaemonSet, at the revision the new pod has.
fn adoptable<'a>(inp: &Inputs<'a>, pod: &DesiredPod) -> Option<&'a Awaiting> {
    let ix = &pod.obj.index;
    inp.awaiting.iter().find(|a| {
        !a.expired
            && a.namespace == ix.namespace
            && Some(&a.owner_uid) == ix.owner_uid.as_ref()
            && Some(&a.hash) == ix.revision_hash.as_ref()
            && a.label_uid != ix.uid
            && inp.snapshot.pod(&a.label_uid).ready_sandbox().is_some()
    })
}

fn blocked(pod: &DesiredPod, e: &PlanError) -> Action {
    let (reason, message, warn) = match e {
        PlanError::Unsupported(u) => (
            "UnsupportedField",
            format!("edgehub cannot run this pod: {u}"),
            true,
        ),
        PlanError::Missing(m) => (
            m.reason,
            format!("edgehub cannot start this pod yet: {m}"),
            m.known_absent,
        ),
    };
    Action::Blocked {
        uid: pod.uid().to_string(),
        reason,
        message,
        warn,
        error: e.clone(),
    }
}

fn waiting(r: Option<&Restarts>, now: Instant) -> bool {
    r.and_then(|r| r.next_allowed).is_some_and(|t| now < t)
}

fn decide_pod(inp: &Inputs<'_>, pod: &DesiredPod, plan: &PodPlan, out: &mut Vec<Action>) {
    let uid = pod.uid();
    let obs = inp.snapshot.pod(uid);
    let refused = waiting(inp.memory.refused.get(uid), inp.now);
    let Some(sb) = obs.ready_sandbox() else {
        if let Some(a) = adoptable(inp, pod) {
            out.push(Action::Adopt {
                label_uid: a.label_uid.clone(),
                uid: uid.to_string(),
            });
            return;
        }
        if refused {
            return;
        }
        let Some(ctx) = &pod.ctx else {
            return;
        };
        let old: Vec<String> = obs.sandboxes().map(|s| s.id.clone()).collect();
        out.push(Action::StartPod {
            uid: uid.to_string(),
            remove_containers: obs
                .containers()
                .filter(|c| old.contains(&c.pod_sandbox_id))
                .map(|c| c.id.clone())
                .collect(),
            remove_sandboxes: old,
            spec: Box::new(StartSpec {
                raw: pod.obj.raw.clone(),
                ctx: ctx.clone(),
                plan: plan.clone(),
            }),
        });
        return;
    };
    let digest = volumes_digest(plan);
    if inp.memory.volumes.get(uid) != Some(&digest) {
        out.push(Action::RefreshVolumes {
            uid: uid.to_string(),
            plan: Box::new(plan.clone()),
            digest,
        });
    }
    let create =
        |c: &ContainerPlan, attempt: u32, replace: Option<String>| Action::CreateContainer {
            uid: uid.to_string(),
            pod: plan.name.clone(),
            sandbox_id: sb.id.clone(),
            container: Box::new(c.clone()),
            sandbox_config: Box::new(plan.sandbox.clone()),
            attempt,
            replace,
        };
    let exited = |c: &api::Container| c.state == api::ContainerState::ContainerExited as i32;
    let created = |c: &api::Container| c.state == api::ContainerState::ContainerCreated as i32;

    // Init containers, one at a time, each to success.
    for ic in &plan.init_containers {
        match obs.latest(&sb.id, &ic.name) {
            None => {
                if !refused {
                    out.push(create(ic, 0, None));
                }
                return;
            }
            Some(c) if exited(c) => {
                let code = obs.facts(&c.id).map(|f| f.exit_code).unwrap_or(-1);
                if code == 0 {
                    continue;
                }
                if plan.restart_policy != RestartPolicy::Never {
                    restart(inp, uid, ic, c, obs.facts(&c.id), refused, &create, out);
                }
                return;
            }
            Some(c) if created(c) => {
                out.push(Action::StartCreated {
                    uid: uid.to_string(),
                    container_id: c.id.clone(),
                });
                return;
            }
            Some(_) => return,
        }
    }
    for pc in &plan.containers {
        match obs.latest(&sb.id, &pc.name) {
            None => {
                if !refused {
                    out.push(create(pc, 0, None));
                }
            }
            Some(c) if created(c) => out.push(Action::StartCreated {
                uid: uid.to_string(),
                container_id: c.id.clone(),
            }),
            Some(c) if exited(c) => {
                let facts = obs.facts(&c.id);
                let again = match plan.restart_policy {
                    RestartPolicy::Always => true,
                    RestartPolicy::OnFailure => facts.map(|f| f.exit_code).unwrap_or(-1) != 0,
                    RestartPolicy::Never => false,
                };
                if again {
                    restart(inp, uid, pc, c, facts, refused, &create, out);
                }
            }
            Some(c) => {
                let key = (uid.to_string(), pc.name.clone());
                let Some(p) = inp.memory.probes.get(&key).filter(|p| p.id == c.id) else {
                    continue;
                };
                if let Some(why) = p.liveness_failed() {
                    out.push(Action::StopContainer {
                        uid: uid.to_string(),
                        container: pc.name.clone(),
                        container_id: c.id.clone(),
                        grace_secs: plan.grace_period_secs,
                        why,
                    });
                    continue;
                }
                let ip = plan
                    .pod_ip
                    .clone()
                    .or_else(|| obs.sandbox_ip(&sb.id).map(str::to_string))
                    .unwrap_or_else(|| "127.0.0.1".into());
                for (kind, spec) in p.due(inp.now) {
                    out.push(Action::Probe {
                        uid: uid.to_string(),
                        container: pc.name.clone(),
                        container_id: c.id.clone(),
                        kind,
                        spec: spec.clone(),
                        ip: ip.clone(),
                    });
                }
            }
        }
    }
}

/// An exited container: start its wait, or replace it once the wait is over.
#[allow(clippy::too_many_arguments)]
fn restart(
    inp: &Inputs<'_>,
    uid: &str,
    plan: &ContainerPlan,
    old: &api::Container,
    facts: Option<&ContainerFacts>,
    refused: bool,
    create: &dyn Fn(&ContainerPlan, u32, Option<String>) -> Action,
    out: &mut Vec<Action>,
) {
    let key = (uid.to_string(), plan.name.clone());
    let r = inp.memory.restarts.get(&key);
    if r.and_then(|r| r.exited.as_deref()) != Some(old.id.as_str()) {
        let ran = facts
            .map(|f| Duration::from_nanos((f.finished_at - f.started_at).max(0) as u64))
            .unwrap_or_default();
        let count = if ran >= BACKOFF_RESET_AFTER {
            1
        } else {
            r.map(|r| r.count).unwrap_or(0) + 1
        };
        out.push(Action::WaitRestart {
            uid: uid.to_string(),
            container: plan.name.clone(),
            restarts: Restarts {
                count,
                next_allowed: Some(inp.now + inp.policy.delay(count)),
                exited: Some(old.id.clone()),
            },
        });
        return;
    }
    if refused || waiting(r, inp.now) {
        return;
    }
    out.push(create(plan, attempt_of(old) + 1, Some(old.id.clone())));
}

/// Sandboxes whose pod is gone or being deleted, deletions to finish, directories to remove.
fn gone(inp: &Inputs<'_>, out: &mut Vec<Action>) {
    let snap = inp.snapshot;
    let cached: HashMap<&str, &DesiredPod> = inp.desired.iter().map(|p| (p.uid(), p)).collect();
    let with_sandbox = snap.sandbox_uids();
    let mut uids: Vec<&str> = with_sandbox.iter().copied().collect();
    uids.sort_unstable();
    for uid in uids {
        if inp.held.contains(uid) {
            continue;
        }
        let grace = match cached.get(uid) {
            Some(p) if !p.obj.index.deleting => continue,
            Some(p) => p.grace_secs,
            // Gone from the cache: only a cache that has seen a full pod list may say so.
            None if !inp.sources_ready => continue,
            None => snap
                .pod(uid)
                .sandboxes()
                .filter_map(|s| s.annotations.get(labels::GRACE_PERIOD))
                .filter_map(|g| g.parse::<i64>().ok())
                .max()
                .unwrap_or(0)
                .max(0),
        };
        let obs = snap.pod(uid);
        out.push(Action::KillPod {
            uid: uid.to_string(),
            sandboxes: obs.sandboxes().map(|s| s.id.clone()).collect(),
            containers: obs.containers().map(|c| c.id.clone()).collect(),
            grace_secs: grace,
        });
    }
    for p in inp.desired.iter().filter(|p| p.obj.index.deleting) {
        if !with_sandbox.contains(p.uid()) && !inp.held.contains(p.uid()) {
            out.push(Action::Finalize {
                uid: p.uid().to_string(),
                namespace: p.obj.index.namespace.clone(),
                name: p.obj.index.name.clone(),
            });
        }
    }
    if inp.sources_ready {
        let mut dirs: Vec<&String> = snap.pod_dirs.iter().collect();
        dirs.sort_unstable();
        for dir in dirs {
            // An adopted pod keeps the directory of the pod it replaced.
            let owner = snap.dir_owner(dir);
            if !cached.contains_key(owner)
                && !with_sandbox.contains(owner)
                && !inp.held.contains(owner)
                && !inp.held.contains(dir.as_str())
            {
                out.push(Action::RemovePodDir { uid: dir.clone() });
            }
        }
    }
}

#[cfg(test)]
#[path = "decide_tests/mod.rs"]
mod tests;
