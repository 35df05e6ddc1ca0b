//! The pure decision of `edgehub controller` (DESIGN §8): for one DaemonSet, which old pods to
//! delete (AdvancedRollingUpdate) and which `PodNeedUpgrade` conditions to write (OTA).
//!
//! It follows OpenYurt's daemonpodupdater:
//! - **Prerequisites.** The DaemonSet has `apps.openyurt.io/update-strategy` set to `OTA` or
//!   `AdvancedRollingUpdate` (case-insensitive) and `spec.updateStrategy.type: OnDelete`. The
//!   rules are [`revision::DaemonSetFacts`]'s, the same the device applies.
//! - **The update revision** is [`revision::update_revision`]: the owned ControllerRevision with
//!   the highest `.revision`, its hash taken from the `controller-revision-hash` label, never
//!   recomputed. A pod is old when its hash label differs.
//! - **Budget.** `apps.openyurt.io/max-unavailable`, an int or a percentage of the DaemonSet's
//!   nodes (the nodes it has pods on, NotReady ones included, as OpenYurt counts them), rounded
//!   up. Absent, `0` or `0%` mean 10%.
//! - **NotReady nodes** are skipped entirely: their pods are neither counted as unavailable nor
//!   deleted. A node the controller has not seen counts as NotReady.
//! - **An old pod that is unavailable** (not Ready for `minReadySeconds`) is deleted without
//!   spending budget; an available old pod only within what is left of it.
//! - **OTA** DaemonSets get a `PodNeedUpgrade` condition per pod ([`revision::need_upgrade`], so
//!   the cloud and the device agree on it), written only when it differs from the pod's.
//!
//! Two additions to OpenYurt keep the budget honest while the controller's own actions are in
//! flight ([`InFlight`], kept by [`super::pending`]): no deletion while an earlier one has not
//! shown up in the pod watch (client-go's expectations), and a node whose old pod is gone but
//! whose replacement has not appeared yet still counts as unavailable. OpenYurt forgets such a
//! node and may overspend the budget in that window.
//!
//! Plain values in, plain values out: no kube-rs, no I/O, no clock. That is why this module
//! compiles without the `controller` feature: its unit tests run in every `cargo test`, not
//! only in builds that pay for kube-rs.

use crate::revision::{self, Condition, DaemonSetFacts, PodFacts, Revision, Strategy};
use std::collections::{BTreeMap, BTreeSet};

/// The DaemonSet annotation with the AdvancedRollingUpdate budget.
pub const MAX_UNAVAILABLE_ANNOTATION: &str = "apps.openyurt.io/max-unavailable";
/// OpenYurt's default budget, also used for `0` and `0%`.
pub const DEFAULT_MAX_UNAVAILABLE: &str = "10%";

/// What the decision needs to know about a DaemonSet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonSetView {
    pub facts: DaemonSetFacts,
    /// The `apps.openyurt.io/max-unavailable` annotation, as written.
    pub max_unavailable: Option<String>,
    /// `spec.minReadySeconds`: how long a pod must be Ready to count as available.
    pub min_ready_seconds: i64,
    /// `metadata.deletionTimestamp` is set: leave it to the garbage collector.
    pub terminating: bool,
}

/// What the decision needs to know about one pod of the DaemonSet.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodView {
    pub name: String,
    pub uid: String,
    /// `spec.nodeName`, or for a pod not yet bound, the node its DaemonSet node affinity names.
    pub node: Option<String>,
    /// The `controller-revision-hash` label.
    pub hash: Option<String>,
    /// `metadata.deletionTimestamp` is set.
    pub terminating: bool,
    /// The Ready condition is True.
    pub ready: bool,
    /// When the Ready condition last changed (Unix seconds), if the pod says.
    pub ready_since: Option<i64>,
    /// The pod's current `PodNeedUpgrade` condition, if any.
    pub need_upgrade: Option<ConditionView>,
}

/// A pod condition as the pod carries it now.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConditionView {
    pub status: String,
    pub reason: Option<String>,
    pub message: Option<String>,
}

/// What the controller itself has in flight for the DaemonSet.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct InFlight {
    /// Deletions sent whose effect (the pod gone or terminating) the watch has not shown yet.
    pub unobserved_deletes: usize,
    /// Nodes whose old pod this controller deleted and whose replacement has not appeared yet.
    pub awaiting_replacement: BTreeSet<String>,
}

/// Everything one decision looks at.
pub struct Input<'a> {
    pub ds: &'a DaemonSetView,
    /// The DaemonSet's ControllerRevisions (by owner uid).
    pub revisions: &'a [Revision],
    /// The DaemonSet's pods (by controlling owner uid).
    pub pods: &'a [PodView],
    /// Whether a node is Ready. Unknown nodes are not.
    pub node_ready: &'a dyn Fn(&str) -> bool,
    pub in_flight: &'a InFlight,
    /// Unix seconds.
    pub now: i64,
}

/// Why a DaemonSet gets nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// No OTA/AdvancedRollingUpdate annotation, or not `OnDelete`.
    NotOptedIn,
    /// The DaemonSet is being deleted.
    Terminating,
    /// No ControllerRevision of the DaemonSet is readable yet.
    NoRevision,
    /// `apps.openyurt.io/max-unavailable` is neither an int nor a percentage.
    InvalidMaxUnavailable(String),
}

/// The outcome for one DaemonSet.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    Skip(Skip),
    Ota(OtaPlan),
    RollingUpdate(RollingPlan),
}

/// OTA: the conditions to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtaPlan {
    /// The update revision's hash.
    pub target: String,
    pub writes: Vec<ConditionWrite>,
    /// Live pods looked at, and how many of them need an upgrade.
    pub pods: usize,
    pub need_upgrade: usize,
}

/// One `PodNeedUpgrade` condition to write on a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConditionWrite {
    pub pod: String,
    pub uid: String,
    pub condition: Condition,
    /// The status changes (True↔False, or the pod had none): `lastTransitionTime` moves.
    pub status_changed: bool,
}

/// AdvancedRollingUpdate: the pods to delete, and where the rollout stands.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RollingPlan {
    /// The update revision's hash.
    pub target: String,
    /// Nodes the DaemonSet has pods on (or awaits a replacement on): the percentage's base.
    pub nodes: usize,
    /// The budget: how many Ready nodes may be without an available pod at once.
    pub max_unavailable: usize,
    /// Ready nodes without an available pod right now, this plan's deletions not included.
    pub unavailable: usize,
    pub deletes: Vec<Delete>,
    /// Ready nodes that run an available pod of the update revision.
    pub updated: usize,
    /// Old pods on Ready nodes left for a later wave.
    pub old_waiting: usize,
    /// NotReady nodes with an old pod: skipped until they turn Ready.
    pub old_on_not_ready: usize,
    /// NotReady nodes skipped, old pod or not.
    pub not_ready_nodes: usize,
    /// Deletions were held back because an earlier one is not observed yet.
    pub held_for_expectations: bool,
    /// Ask again after this many seconds: a pod turns available then (`minReadySeconds`).
    pub recheck_after: Option<i64>,
}

/// Why a pod is deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeleteWhy {
    /// Old and unavailable: replaced without spending budget.
    Unavailable,
    /// Old and available: spends one unit of budget.
    Budget,
}

/// One old pod to delete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delete {
    pub pod: String,
    pub uid: String,
    pub node: String,
    /// The revision hash the pod runs.
    pub from: Option<String>,
    pub why: DeleteWhy,
}

/// Decides what to do for one DaemonSet.
pub fn decide(input: &Input) -> Decision {
    let ds = input.ds;
    if ds.terminating {
        return Decision::Skip(Skip::Terminating);
    }
    let Some(strategy) = ds.facts.strategy.filter(|_| ds.facts.on_delete) else {
        return Decision::Skip(Skip::NotOptedIn);
    };
    let Some(target) = revision::update_revision(input.revisions).map(|r| r.hash.clone()) else {
        return Decision::Skip(Skip::NoRevision);
    };
    match strategy {
        Strategy::Ota => Decision::Ota(ota(input, target)),
        Strategy::AdvancedRollingUpdate => match rolling(input, target) {
            Ok(plan) => Decision::RollingUpdate(plan),
            Err(skip) => Decision::Skip(skip),
        },
    }
}

fn ota(input: &Input, target: String) -> OtaPlan {
    let mut plan = OtaPlan {
        target,
        writes: Vec::new(),
        pods: 0,
        need_upgrade: 0,
    };
    for pod in input.pods.iter().filter(|p| !p.terminating) {
        let facts = PodFacts {
            owner_kind: Some("DaemonSet"),
            hash: pod.hash.as_deref(),
            terminating: false,
        };
        let need = revision::need_upgrade(&facts, Some(&input.ds.facts), input.revisions);
        let condition = need.condition();
        plan.pods += 1;
        if need.needed() {
            plan.need_upgrade += 1;
        }
        let current = pod.need_upgrade.as_ref();
        let same = current.is_some_and(|c| {
            c.status == condition.status
                && c.reason.as_deref() == Some(condition.reason)
                && c.message == condition.message
        });
        if !same {
            plan.writes.push(ConditionWrite {
                pod: pod.name.clone(),
                uid: pod.uid.clone(),
                status_changed: current.map(|c| c.status.as_str()) != Some(condition.status),
                condition,
            });
        }
    }
    plan
}

/// The pods of one node, live ones sorted into the update revision and older ones.
struct NodePods<'a> {
    new: Vec<&'a PodView>,
    old: Vec<&'a PodView>,
}

fn rolling(input: &Input, target: String) -> Result<RollingPlan, Skip> {
    let mut by_node: BTreeMap<&str, NodePods> = BTreeMap::new();
    for pod in input.pods {
        let Some(node) = pod.node.as_deref() else {
            continue;
        };
        let entry = by_node.entry(node).or_insert_with(|| NodePods {
            new: Vec::new(),
            old: Vec::new(),
        });
        if pod.terminating {
            continue;
        }
        if pod.hash.as_deref() == Some(target.as_str()) {
            entry.new.push(pod);
        } else {
            entry.old.push(pod);
        }
    }
    for node in &input.in_flight.awaiting_replacement {
        by_node.entry(node.as_str()).or_insert_with(|| NodePods {
            new: Vec::new(),
            old: Vec::new(),
        });
    }
    let max_unavailable = max_unavailable(input.ds.max_unavailable.as_deref(), by_node.len())
        .map_err(Skip::InvalidMaxUnavailable)?;
    let mut plan = RollingPlan {
        target,
        nodes: by_node.len(),
        max_unavailable,
        ..RollingPlan::default()
    };
    let min_ready = input.ds.min_ready_seconds;
    let mut free = Vec::new();
    let mut candidates = Vec::new();
    for (node, pods) in &by_node {
        if !(input.node_ready)(node) {
            plan.not_ready_nodes += 1;
            if !pods.old.is_empty() {
                plan.old_on_not_ready += 1;
            }
            continue;
        }
        match (pods.new.as_slice(), pods.old.as_slice()) {
            // Nothing live (the old pod is terminating, or its replacement is not there yet),
            // both revisions at once, or duplicates: the DaemonSet controller has work to do
            // here first. The node is unavailable meanwhile.
            ([], []) | ([_], [_]) => plan.unavailable += 1,
            (new, old) if new.len() > 1 || old.len() > 1 => plan.unavailable += 1,
            ([new], []) => match availability(new, min_ready, input.now) {
                Availability::Available => plan.updated += 1,
                Availability::After(secs) => {
                    plan.unavailable += 1;
                    plan.recheck_after = Some(plan.recheck_after.map_or(secs, |r| r.min(secs)));
                }
                Availability::No => plan.unavailable += 1,
            },
            ([], [old]) => match availability(old, min_ready, input.now) {
                Availability::Available => candidates.push((*node, *old)),
                _ => free.push((*node, *old)),
            },
            // The guards above cover every shape; a pattern the compiler cannot prove complete.
            _ => plan.unavailable += 1,
        }
    }
    let spend = max_unavailable
        .saturating_sub(plan.unavailable)
        .min(candidates.len());
    let chosen: Vec<(&str, &PodView, DeleteWhy)> = free
        .iter()
        .map(|(n, p)| (*n, *p, DeleteWhy::Unavailable))
        .chain(
            candidates[..spend]
                .iter()
                .map(|(n, p)| (*n, *p, DeleteWhy::Budget)),
        )
        .collect();
    plan.old_waiting = free.len() + candidates.len();
    if input.in_flight.unobserved_deletes > 0 {
        plan.held_for_expectations = !chosen.is_empty();
    } else {
        plan.old_waiting -= chosen.len();
        plan.deletes = chosen
            .into_iter()
            .map(|(node, pod, why)| Delete {
                pod: pod.name.clone(),
                uid: pod.uid.clone(),
                node: node.to_string(),
                from: pod.hash.clone(),
                why,
            })
            .collect();
    }
    Ok(plan)
}

enum Availability {
    Available,
    /// Ready, and available after this many more seconds.
    After(i64),
    No,
}

/// A pod is available when it has been Ready for `minReadySeconds` (Kubernetes'
/// `IsPodAvailable`: with a positive `minReadySeconds`, a Ready condition without a
/// transition time does not count).
fn availability(pod: &PodView, min_ready: i64, now: i64) -> Availability {
    if !pod.ready {
        return Availability::No;
    }
    if min_ready <= 0 {
        return Availability::Available;
    }
    match pod.ready_since {
        Some(since) if since + min_ready < now => Availability::Available,
        Some(since) => Availability::After(since + min_ready + 1 - now),
        None => Availability::No,
    }
}

/// The budget: `value` (an int, or a percentage of `nodes` rounded up). Absent, `0` and `0%`
/// mean [`DEFAULT_MAX_UNAVAILABLE`], as in OpenYurt.
pub fn max_unavailable(value: Option<&str>, nodes: usize) -> Result<usize, String> {
    let parse = |v: &str| -> Result<(u64, bool), String> {
        let (digits, percent) = match v.strip_suffix('%') {
            Some(d) => (d, true),
            None => (v, false),
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!(
                "{MAX_UNAVAILABLE_ANNOTATION} {v:?} is neither an int nor a percentage"
            ));
        }
        let n = digits
            .parse::<u64>()
            .map_err(|e| format!("{MAX_UNAVAILABLE_ANNOTATION} {v:?}: {e}"))?;
        Ok((n, percent))
    };
    let (n, percent) = match value.map(str::trim) {
        None => parse(DEFAULT_MAX_UNAVAILABLE)?,
        Some(v) => match parse(v)? {
            (0, _) => parse(DEFAULT_MAX_UNAVAILABLE)?,
            other => other,
        },
    };
    let n = usize::try_from(n).unwrap_or(usize::MAX);
    if percent {
        Ok(n.saturating_mul(nodes).div_ceil(100))
    } else {
        Ok(n)
    }
}

#[cfg(test)]
mod tests;
