//! Pod status, pure: what the runtime shows of a pod as a v1 `status`, whether the apiserver
//! already holds it, and the two-way strategic merge patch that moves the apiserver's copy to
//! it, the way the kubelet's status manager builds one.
//!
//! Three rules keep an idle node quiet and every patch acceptable:
//! - edgehub owns some fields (phase, its conditions, container statuses, IPs, start time) and
//!   merges them onto the status the apiserver holds; other writers' conditions stay;
//! - "already held" is decided the way the apiserver stores a status: a member that is null or
//!   an empty object (`lastState: {}`, `lastProbeTime: null`) is the same as one that is absent;
//! - the patch deletes what is gone: an old pod IP gets `$patch: delete` and the list a
//!   `$setElementOrder`, so a new IP replaces the old instead of joining it (one IP per family,
//!   or the apiserver answers 422), and the pod's `metadata.uid` rides along, so a patch never
//!   lands on a replacement pod of the same name.

use super::observe::{ContainerFacts, PodObserved};
use super::probes::ContainerProbes;
use crate::cri::api;
use crate::podspec::{ContainerPlan, PodPlan, RestartPolicy};
use crate::store::StoredObject;
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::time::Duration;

/// The conditions edgehub sets; any other type belongs to someone else and is kept.
pub const OWN_CONDITIONS: &[&str] = &[
    "PodScheduled",
    "Initialized",
    "ContainersReady",
    "Ready",
    "PodImageReady",
];

/// A container as the pod status reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerView {
    pub name: String,
    pub image: String,
    pub image_id: String,
    /// `containerd://<id>`, empty before the container exists.
    pub container_id: String,
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

fn state_json(s: &ViewState) -> Value {
    match s {
        ViewState::Waiting { reason } => json!({"waiting": {"reason": reason}}),
        ViewState::Running { started_at } => json!({"running": {"startedAt": started_at}}),
        ViewState::Terminated {
            exit_code,
            reason,
            started_at,
            finished_at,
        } => json!({"terminated": {
            "exitCode": exit_code, "reason": reason, "startedAt": started_at, "finishedAt": finished_at
        }}),
    }
}

fn container_status_json(c: &ContainerView) -> Value {
    let mut v = json!({
        "name": c.name,
        "state": state_json(&c.state),
        "lastState": {},
        "ready": c.ready,
        "restartCount": c.restart_count,
        "image": c.image,
        "imageID": c.image_id,
        "started": matches!(c.state, ViewState::Running { .. }),
    });
    if !c.container_id.is_empty() {
        v["containerID"] = c.container_id.clone().into();
    }
    v
}

pub fn nanos_to_rfc3339(n: i64) -> String {
    crate::time::rfc3339(std::time::UNIX_EPOCH + Duration::from_nanos(n.max(0) as u64))
}

/// One container's view from the snapshot and its probes.
fn view(
    p: &ContainerPlan,
    c: Option<&api::Container>,
    facts: Option<&ContainerFacts>,
    probes: Option<&ContainerProbes>,
    runtime_name: &str,
) -> ContainerView {
    let Some(c) = c else {
        return ContainerView {
            name: p.name.clone(),
            image: p.image.clone(),
            image_id: String::new(),
            container_id: String::new(),
            restart_count: 0,
            state: ViewState::Waiting {
                reason: "ContainerCreating".into(),
            },
            ready: false,
        };
    };
    let f = facts.cloned().unwrap_or_default();
    let state = if c.state == api::ContainerState::ContainerRunning as i32 {
        ViewState::Running {
            started_at: nanos_to_rfc3339(f.started_at),
        }
    } else if c.state == api::ContainerState::ContainerExited as i32 {
        ViewState::Terminated {
            exit_code: f.exit_code,
            reason: match (f.reason.as_str(), f.exit_code) {
                ("", 0) => "Completed".into(),
                ("", _) => "Error".into(),
                (r, _) => r.to_string(),
            },
            started_at: nanos_to_rfc3339(f.started_at),
            finished_at: nanos_to_rfc3339(f.finished_at),
        }
    } else {
        ViewState::Waiting {
            reason: "ContainerCreating".into(),
        }
    };
    let passing = match &p.readiness {
        None => true,
        Some(_) => probes.is_some_and(|pr| pr.id == c.id && pr.ready()),
    };
    ContainerView {
        name: p.name.clone(),
        image: p.image.clone(),
        image_id: f.image_ref,
        container_id: format!("{runtime_name}://{}", c.id),
        restart_count: c.metadata.as_ref().map(|m| m.attempt).unwrap_or(0),
        ready: matches!(state, ViewState::Running { .. }) && passing,
        state,
    }
}

/// The status of a pod as the runtime shows it now.
pub fn observed(
    plan: &PodPlan,
    obs: PodObserved<'_>,
    probes: &HashMap<(String, String), ContainerProbes>,
    host_ip: Option<&str>,
    runtime_name: &str,
) -> Value {
    let sandbox = obs.ready_sandbox();
    let views = |list: &[ContainerPlan]| -> Vec<ContainerView> {
        list.iter()
            .map(|p| {
                let c = sandbox.and_then(|sb| obs.latest(&sb.id, &p.name));
                view(
                    p,
                    c,
                    c.and_then(|c| obs.facts(&c.id)),
                    probes.get(&(plan.uid.clone(), p.name.clone())),
                    runtime_name,
                )
            })
            .collect()
    };
    let pod_ip = plan
        .pod_ip
        .clone()
        .or_else(|| sandbox.and_then(|sb| obs.sandbox_ip(&sb.id).map(str::to_string)));
    pod_status(
        &views(&plan.init_containers),
        &views(&plan.containers),
        host_ip,
        pod_ip.as_deref(),
        sandbox.map(|s| nanos_to_rfc3339(s.created_at)).as_deref(),
        plan.restart_policy,
    )
}

/// The `status` of a pod edgehub runs (a host-network pod's podIP is the host's). Conditions
/// carry no times here; [`with_times`] adds them against what the apiserver holds.
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
    let mut status = json!({
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
        status["hostIPs"] = json!([{"ip": ip}]);
    }
    if let Some(ip) = pod_ip {
        status["podIP"] = ip.into();
        status["podIPs"] = json!([{"ip": ip}]);
    }
    if let Some(t) = start_time {
        status["startTime"] = t.into();
    }
    status
}

/// OpenYurt's `PodImageReady`: True once a pre-pull put the images of the revision the pod
/// needs on the node (message `controllerrevision: <hash>`), False when the revision pulled is
/// not the one needed any more.
pub fn image_ready(status: &mut Value, pulled: &str, needed: Option<&str>) {
    let cond = match needed {
        Some(t) if t == pulled => json!({"type": "PodImageReady", "status": "True",
            "reason": "ImagesPulled", "message": format!("controllerrevision: {pulled}")}),
        _ => json!({"type": "PodImageReady", "status": "False",
            "reason": "RevisionChanged", "message": format!("controllerrevision: {pulled}")}),
    };
    if let Some(Value::Array(conds)) = status.get_mut("conditions") {
        conds.push(cond);
    }
}

/// The status of a pod edgehub cannot run or cannot start yet: Ready=False with the reason.
pub fn blocked_status(reason: &str, message: &str) -> Value {
    json!({
        "phase": "Pending",
        "conditions": [
            {"type": "Ready", "status": "False", "reason": reason, "message": message},
        ],
    })
}

fn conditions(v: &Value) -> &[Value] {
    v.get("conditions")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

fn find<'a>(list: &'a [Value], ty: &Value) -> Option<&'a Value> {
    list.iter().find(|c| c.get("type") == Some(ty))
}

/// Gives each of `ours`' conditions its times, as the kubelet does: `lastTransitionTime` is
/// when its status last changed (from what the apiserver holds, else from what is already
/// queued, else `now`), so re-queuing an unchanged status writes nothing.
pub fn with_times(ours: &Value, current: &Value, queued: Option<&Value>, now: &str) -> Value {
    let mut out = ours.clone();
    if let Some(Value::Array(conds)) = out.get_mut("conditions") {
        for c in conds.iter_mut() {
            let ty = c["type"].clone();
            let since = [Some(current), queued]
                .into_iter()
                .flatten()
                .filter_map(|v| find(conditions(v), &ty))
                .find(|h| h.get("status") == c.get("status"))
                .and_then(|h| h.get("lastTransitionTime"))
                .filter(|t| !t.is_null())
                .cloned()
                .unwrap_or_else(|| now.into());
            c["lastProbeTime"] = Value::Null;
            c["lastTransitionTime"] = since;
        }
    }
    out
}

/// `ours` merged onto the status the apiserver holds: edgehub's fields replace, its
/// conditions replace theirs by type (in place), everyone else's stay.
pub fn merge_onto(current: &Value, ours: &Value) -> Value {
    let mut out = current.as_object().cloned().unwrap_or_default();
    let Some(ours) = ours.as_object() else {
        return Value::Object(out);
    };
    for (k, v) in ours {
        if k != "conditions" {
            out.insert(k.clone(), v.clone());
            continue;
        }
        let mut merged: Vec<Value> = conditions(current).to_vec();
        for c in v.as_array().map(Vec::as_slice).unwrap_or(&[]) {
            match merged.iter_mut().find(|m| m.get("type") == c.get("type")) {
                // Same status, reason and message: the apiserver's entry (its times) stays.
                Some(m) if same_condition(m, c) => {}
                Some(m) => *m = c.clone(),
                None => merged.push(c.clone()),
            }
        }
        out.insert(k.clone(), Value::Array(merged));
    }
    Value::Object(out)
}

fn same_condition(a: &Value, b: &Value) -> bool {
    ["status", "reason", "message"].iter().all(|k| {
        same(
            a.get(*k).unwrap_or(&Value::Null),
            b.get(*k).unwrap_or(&Value::Null),
        )
    })
}

/// `v` as the apiserver would store it, for comparison: members that are null or empty
/// objects dropped, recursively.
fn canonical(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .map(|(k, x)| (k, canonical(x)))
                .filter(|(_, x)| !x.is_null() && x.as_object().is_none_or(|o| !o.is_empty()))
                .map(|(k, x)| (k.clone(), x))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(canonical).collect()),
        other => other.clone(),
    }
}

/// Equal as the apiserver stores them.
pub fn same(a: &Value, b: &Value) -> bool {
    canonical(a) == canonical(b)
}

/// Whether the apiserver's status differs from `ours` merged onto it.
pub fn needs_patch(current: &Value, ours: &Value) -> bool {
    !same(&merge_onto(current, ours), current)
}

/// The merge key of the status lists a strategic merge patch merges item by item
/// (`patchStrategy: merge` in the API); any other list is replaced whole
/// (`containerStatuses` is `listType: atomic`).
fn merge_key(field: &str) -> Option<&'static str> {
    match field {
        "conditions" => Some("type"),
        "podIPs" | "hostIPs" => Some("ip"),
        _ => None,
    }
}

/// The two-way strategic merge patch from `old` to `new` for a map: changed members, nulls for
/// removed ones, merge-keyed lists item by item.
fn map_patch(old: &Map<String, Value>, new: &Map<String, Value>) -> Map<String, Value> {
    let mut patch = Map::new();
    for (k, nv) in new {
        let ov = old.get(k);
        if ov.is_some_and(|ov| same(ov, nv)) {
            continue;
        }
        match (merge_key(k), ov, nv) {
            (Some(key), Some(Value::Array(ol)), Value::Array(nl)) => {
                let (items, order) = list_patch(key, ol, nl);
                patch.insert(format!("$setElementOrder/{k}"), Value::Array(order));
                patch.insert(k.clone(), Value::Array(items));
            }
            (None, Some(Value::Object(om)), Value::Object(nm)) => {
                patch.insert(k.clone(), Value::Object(map_patch(om, nm)));
            }
            _ => {
                patch.insert(k.clone(), nv.clone());
            }
        }
    }
    for (k, ov) in old {
        if !new.contains_key(k) && !canonical(ov).is_null() {
            patch.insert(k.clone(), Value::Null);
        }
    }
    patch
}

fn list_patch(key: &str, old: &[Value], new: &[Value]) -> (Vec<Value>, Vec<Value>) {
    let id = |v: &Value| v.get(key).cloned();
    let mut items = Vec::new();
    for n in new {
        match old.iter().find(|o| id(o).is_some() && id(o) == id(n)) {
            Some(o) if same(o, n) => {}
            Some(Value::Object(om)) => {
                let mut p = match n.as_object() {
                    Some(nm) => map_patch(om, nm),
                    None => Map::new(),
                };
                if let Some(k) = id(n) {
                    p.insert(key.to_string(), k);
                }
                items.push(Value::Object(p));
            }
            _ => items.push(n.clone()),
        }
    }
    for o in old {
        if let Some(k) = id(o) {
            if !new.iter().any(|n| id(n).as_ref() == Some(&k)) {
                items.push(json!({key: k, "$patch": "delete"}));
            }
        }
    }
    let order = new
        .iter()
        .filter_map(|n| id(n).map(|k| json!({ key: k })))
        .collect();
    (items, order)
}

/// The body of a `pods/status` PATCH moving the apiserver's `old` status to `new`, or `None`
/// when there is nothing to change.
pub fn two_way_patch(pod_uid: &str, old: &Value, new: &Value) -> Option<Value> {
    let empty = Map::new();
    let patch = map_patch(
        old.as_object().unwrap_or(&empty),
        new.as_object().unwrap_or(&empty),
    );
    if patch.is_empty() {
        return None;
    }
    Some(json!({"metadata": {"uid": pod_uid}, "status": patch}))
}

/// A Warning Event about a pod. Its name is fixed per pod and reason: the same warning again
/// is the same Event with a higher count (the kubelet's event series).
pub fn warning_event(
    pod: &StoredObject,
    reason: &str,
    message: &str,
    node: &str,
    now: &str,
) -> Value {
    pod_event(pod, "Warning", reason, message, node, now)
}

/// An Event about a pod, `Normal` or `Warning`, named per pod and reason.
pub fn pod_event(
    pod: &StoredObject,
    kind: &str,
    reason: &str,
    message: &str,
    node: &str,
    now: &str,
) -> Value {
    let ix = &pod.index;
    json!({
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": format!("{}.edgehub-{}", ix.name, reason.to_ascii_lowercase()), "namespace": ix.namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": ix.namespace, "name": ix.name, "uid": ix.uid},
        "reason": reason,
        "message": message,
        "type": kind,
        "source": {"component": "edgehub", "host": node},
        "reportingComponent": "edgehub",
        "reportingInstance": node,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    })
}

#[cfg(test)]
#[path = "status_tests.rs"]
mod tests;
