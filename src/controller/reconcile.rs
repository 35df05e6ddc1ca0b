//! One reconcile of one DaemonSet: read the caches into the pure [`decide`] input, then carry
//! out what the decision asks: OTA conditions on pods (`ota`), deletions for the rolling
//! update (`rolling`), and the Events that say why.

use super::decide::{self, Decision, DeleteWhy, Input, OtaPlan, PodView, RollingPlan, Skip};
use super::metrics::{inc, DaemonSetGauges, Metrics};
use super::pending::Pending;
use super::views;
use super::COMPONENT;
use crate::revision::{Revision, POD_NEED_UPGRADE};
use futures_util::{stream, StreamExt};
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet};
use k8s_openapi::api::core::v1::{Event, EventSource, Node, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::watch;

/// Deletions and condition writes in flight at once per reconcile.
const WRITE_CONCURRENCY: usize = 16;
/// At most this many pod names in one Event message.
const EVENT_NAMES: usize = 10;

/// Why a reconcile failed; it is retried with backoff.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("the caches stopped")]
    CachesGone,
    #[error("{failed} of {total} pod deletions failed, first: {first}")]
    Delete {
        failed: usize,
        total: usize,
        first: kube::Error,
    },
    #[error("{failed} of {total} PodNeedUpgrade writes failed, first: {first}")]
    Condition {
        failed: usize,
        total: usize,
        first: kube::Error,
    },
}

/// What every reconcile shares.
pub(super) struct Ctx {
    pub(super) client: Client,
    pub(super) pods: Store<Pod>,
    pub(super) nodes: Store<Node>,
    pub(super) revisions: Store<ControllerRevision>,
    /// True once the pod, Node and ControllerRevision caches hold a complete first list.
    pub(super) synced: watch::Receiver<bool>,
    pub(super) pending: Mutex<Pending>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) identity: String,
    pub(super) resync: Duration,
    /// `(DaemonSet key, annotation value)` pairs already warned about by an Event.
    pub(super) warned: Mutex<HashSet<(String, String)>>,
    pub(super) event_seq: AtomicU64,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn now_ms() -> i64 {
    crate::time::now_ms()
}

pub(super) async fn reconcile(ds: Arc<DaemonSet>, ctx: Arc<Ctx>) -> Result<Action, ReconcileError> {
    // Decide only on complete caches: a half-listed revision cache would name the wrong
    // update revision, a half-listed pod cache would miss old pods.
    ctx.synced
        .clone()
        .wait_for(|s| *s)
        .await
        .map_err(|_| ReconcileError::CachesGone)?;
    let ns = ds.namespace().unwrap_or_default();
    let name = ds.name_any();
    let key = format!("{ns}/{name}");
    let uid = ds.uid().unwrap_or_default();
    let view = views::daemonset(&ds);
    // A DaemonSet that is not opted in is decided on its own facts: no need to gather its
    // pods from the cache on every one of their events.
    let opted_in = view.facts.strategy.is_some() && view.facts.on_delete && !view.terminating;
    let (pods, crs) = if opted_in {
        (ctx.pods.state(), ctx.revisions.state())
    } else {
        (Vec::new(), Vec::new())
    };
    let pods: Vec<PodView> = pods
        .iter()
        .filter(|p| views::daemonset_owner(p) == Some(uid.as_str()))
        .map(|p| views::pod(p))
        .collect();
    let revisions: Vec<Revision> = crs
        .iter()
        .filter(|c| views::revision_owner(c) == Some(uid.as_str()))
        .filter_map(|c| match views::revision(c) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::debug!(daemonset = %key, error = %e, "skipping an unreadable ControllerRevision");
                None
            }
        })
        .collect();
    let in_flight = lock(&ctx.pending).observe(&key, &pods, now_ms());
    let nodes = &ctx.nodes;
    let node_ready = |n: &str| {
        nodes
            .get(&ObjectRef::new(n))
            .is_some_and(|n| views::node_ready(&n))
    };
    let decision = decide::decide(&Input {
        ds: &view,
        revisions: &revisions,
        pods: &pods,
        node_ready: &node_ready,
        in_flight: &in_flight,
        now: now_ms() / 1000,
    });
    let action = match decision {
        Decision::Skip(skip) => {
            ctx.metrics.set_daemonset(&ns, &name, None);
            match skip {
                Skip::InvalidMaxUnavailable(message) => {
                    tracing::warn!(daemonset = %key, %message, "not rolling");
                    let value = view.max_unavailable.clone().unwrap_or_default();
                    if lock(&ctx.warned).insert((key.clone(), value)) {
                        event(&ctx, &ds, "Warning", "InvalidMaxUnavailable", &message).await;
                    }
                }
                other => tracing::debug!(daemonset = %key, reason = ?other, "ignored"),
            }
            Action::await_change()
        }
        Decision::Ota(plan) => ota(&ctx, &ds, &key, plan).await?,
        Decision::RollingUpdate(plan) => rolling(&ctx, &ds, &key, plan).await?,
    };
    inc(&ctx.metrics.reconciles);
    Ok(action)
}

async fn ota(
    ctx: &Ctx,
    ds: &DaemonSet,
    key: &str,
    plan: OtaPlan,
) -> Result<Action, ReconcileError> {
    let ns = ds.namespace().unwrap_or_default();
    ctx.metrics.set_daemonset(
        &ns,
        &ds.name_any(),
        Some(DaemonSetGauges {
            strategy: "ota",
            need_upgrade: plan.need_upgrade as u64,
            ..DaemonSetGauges::default()
        }),
    );
    if plan.writes.is_empty() {
        return Ok(Action::requeue(ctx.resync));
    }
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let now = Time(Timestamp::now());
    let results: Vec<_> = stream::iter(plan.writes.clone())
        .map(|w| {
            let mut condition = serde_json::json!({
                "type": POD_NEED_UPGRADE,
                "status": w.condition.status,
                "reason": w.condition.reason,
                "message": w.condition.message,
            });
            if w.status_changed {
                condition["lastTransitionTime"] = serde_json::json!(now);
            }
            // A strategic merge patch merges conditions by type: the pod's other conditions,
            // written by its kubelet (or edgehub), stay as they are.
            let patch = serde_json::json!({"status": {"conditions": [condition]}});
            let api = api.clone();
            async move {
                let r = api
                    .patch_status(&w.pod, &PatchParams::default(), &Patch::Strategic(patch))
                    .await;
                (w, r)
            }
        })
        .buffer_unordered(WRITE_CONCURRENCY)
        .collect()
        .await;
    let total = results.len();
    let (mut written, mut failed, mut first) = (0, 0, None);
    let mut set_true = Vec::new();
    for (w, r) in results {
        match r {
            Ok(_) => {
                written += 1;
                if w.condition.status == "True" {
                    inc(&ctx.metrics.conditions_true);
                    set_true.push(w.pod.clone());
                } else {
                    inc(&ctx.metrics.conditions_false);
                }
                tracing::debug!(daemonset = %key, pod = %w.pod, status = w.condition.status, reason = w.condition.reason, "PodNeedUpgrade written");
            }
            // The pod went away meanwhile: nothing to mark.
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => {
                inc(&ctx.metrics.condition_errors);
                failed += 1;
                tracing::warn!(daemonset = %key, pod = %w.pod, error = %e, "cannot write PodNeedUpgrade");
                first.get_or_insert(e);
            }
        }
    }
    tracing::info!(daemonset = %key, target = %plan.target, written, need_upgrade = plan.need_upgrade, pods = plan.pods, "PodNeedUpgrade conditions updated");
    if !set_true.is_empty() {
        let message = format!(
            "PodNeedUpgrade is True on {} pod(s) for controllerrevision {}: {}",
            set_true.len(),
            plan.target,
            names(&set_true)
        );
        event(ctx, ds, "Normal", "PodNeedUpgrade", &message).await;
    }
    match first {
        Some(first) => Err(ReconcileError::Condition {
            failed,
            total,
            first,
        }),
        None => Ok(Action::requeue(ctx.resync)),
    }
}

fn names(pods: &[String]) -> String {
    let mut s = pods
        .iter()
        .take(EVENT_NAMES)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if pods.len() > EVENT_NAMES {
        s.push_str(&format!(" and {} more", pods.len() - EVENT_NAMES));
    }
    s
}

async fn rolling(
    ctx: &Ctx,
    ds: &DaemonSet,
    key: &str,
    plan: RollingPlan,
) -> Result<Action, ReconcileError> {
    let ns = ds.namespace().unwrap_or_default();
    ctx.metrics.set_daemonset(
        &ns,
        &ds.name_any(),
        Some(DaemonSetGauges {
            strategy: "advanced_rolling_update",
            old_ready: (plan.old_waiting + plan.deletes.len()) as u64,
            old_not_ready: plan.old_on_not_ready as u64,
            updated: plan.updated as u64,
            max_unavailable: plan.max_unavailable as u64,
            need_upgrade: 0,
        }),
    );
    tracing::debug!(
        daemonset = %key,
        target = %plan.target,
        nodes = plan.nodes,
        max_unavailable = plan.max_unavailable,
        unavailable = plan.unavailable,
        updated = plan.updated,
        old_waiting = plan.old_waiting,
        old_on_not_ready = plan.old_on_not_ready,
        deletes = plan.deletes.len(),
        held = plan.held_for_expectations,
        "rolling update"
    );
    let requeue = plan
        .recheck_after
        .map(|s| Duration::from_secs(u64::try_from(s.max(1)).unwrap_or(1)))
        .map_or(ctx.resync, |d| d.min(ctx.resync));
    if plan.deletes.is_empty() {
        return Ok(Action::requeue(requeue));
    }
    {
        let mut pending = lock(&ctx.pending);
        let now = now_ms();
        for d in &plan.deletes {
            pending.deleting(key, &d.uid, &d.node, now);
        }
    }
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let results: Vec<_> = stream::iter(plan.deletes.clone())
        .map(|d| {
            let api = api.clone();
            // The uid precondition: never delete a pod that replaced the one decided on.
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: Some(d.uid.clone()),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            async move {
                let r = api.delete(&d.pod, &params).await;
                (d, r)
            }
        })
        .buffer_unordered(WRITE_CONCURRENCY)
        .collect()
        .await;
    let total = results.len();
    let (mut failed, mut first) = (0, None);
    let mut deleted = Vec::new();
    for (d, r) in results {
        match r {
            Ok(_) => {
                inc(match d.why {
                    DeleteWhy::Budget => &ctx.metrics.deleted_budget,
                    DeleteWhy::Unavailable => &ctx.metrics.deleted_unavailable,
                });
                tracing::info!(daemonset = %key, pod = %d.pod, node = %d.node, from = d.from.as_deref().unwrap_or(""), to = %plan.target, why = ?d.why, "deleted old pod");
                deleted.push(format!("{} on {}", d.pod, d.node));
            }
            // Gone already (404), or replaced by a pod with another uid (409): either way the
            // old pod is no more.
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {
                lock(&ctx.pending).already_gone(key, &d.uid);
            }
            Err(e) => {
                lock(&ctx.pending).failed(key, &d.uid, &d.node);
                inc(&ctx.metrics.delete_errors);
                failed += 1;
                tracing::warn!(daemonset = %key, pod = %d.pod, node = %d.node, error = %e, "cannot delete old pod");
                first.get_or_insert(e);
            }
        }
    }
    if !deleted.is_empty() {
        inc(&ctx.metrics.waves);
        let free = plan
            .deletes
            .iter()
            .filter(|d| d.why == DeleteWhy::Unavailable)
            .count();
        let message = format!(
            "Deleted {} old pod(s) for controllerrevision {} ({free} unavailable, budget {} of {} nodes, {} unavailable before; {} NotReady node(s) skipped): {}",
            deleted.len(),
            plan.target,
            plan.max_unavailable,
            plan.nodes,
            plan.unavailable,
            plan.not_ready_nodes,
            names(&deleted),
        );
        event(ctx, ds, "Normal", "AdvancedRollingUpdate", &message).await;
    }
    match first {
        Some(first) => {
            let message = format!("{failed} of {total} old pod deletions failed: {first}");
            event(ctx, ds, "Warning", "FailedDelete", &message).await;
            Err(ReconcileError::Delete {
                failed,
                total,
                first,
            })
        }
        None => Ok(Action::requeue(requeue)),
    }
}

/// Posts a core/v1 Event about the DaemonSet. A failure is logged and counted, never fatal.
async fn event(ctx: &Ctx, ds: &DaemonSet, kind: &str, reason: &str, message: &str) {
    let ns = ds.namespace().unwrap_or_default();
    let now = Timestamp::now();
    let seq = ctx.event_seq.fetch_add(1, Ordering::Relaxed);
    let ev = Event {
        metadata: ObjectMeta {
            // Unique like the client-go recorder's `<object>.<hex nanos>`, plus a sequence.
            name: Some(format!(
                "{}.{:x}{:x}",
                ds.name_any(),
                now.as_nanosecond(),
                seq
            )),
            namespace: Some(ns.clone()),
            ..ObjectMeta::default()
        },
        involved_object: ObjectReference {
            api_version: Some("apps/v1".into()),
            kind: Some("DaemonSet".into()),
            name: Some(ds.name_any()),
            namespace: Some(ns.clone()),
            uid: ds.uid(),
            resource_version: ds.resource_version(),
            ..ObjectReference::default()
        },
        reason: Some(reason.into()),
        message: Some(message.into()),
        type_: Some(kind.into()),
        source: Some(EventSource {
            component: Some(COMPONENT.into()),
            host: None,
        }),
        first_timestamp: Some(Time(now)),
        last_timestamp: Some(Time(now)),
        count: Some(1),
        reporting_component: Some(COMPONENT.into()),
        reporting_instance: Some(ctx.identity.clone()),
        ..Event::default()
    };
    match Api::<Event>::namespaced(ctx.client.clone(), &ns)
        .create(&PostParams::default(), &ev)
        .await
    {
        Ok(_) => inc(&ctx.metrics.events),
        Err(e) => {
            inc(&ctx.metrics.event_errors);
            tracing::warn!(daemonset = %ds.name_any(), %reason, error = %e, "cannot post Event");
        }
    }
}
