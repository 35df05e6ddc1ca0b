//! The Node's bodies as pure functions of a [`NodeSample`] and the config: what the kubelet
//! would register, report and renew.

use super::{
    NodeConfig, NodeSample, Taint, KUBELET_VERSION, LEASE_NAMESPACE, MANAGED_BY_ANNOTATION,
};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// The labels of the Node: the kubelet's well-known ones and the configured ones.
pub fn labels(cfg: &NodeConfig, node_name: &str, arch: &str) -> BTreeMap<String, String> {
    let mut l = BTreeMap::new();
    l.insert("kubernetes.io/hostname".to_string(), node_name.to_string());
    l.insert("kubernetes.io/os".to_string(), "linux".to_string());
    l.insert("kubernetes.io/arch".to_string(), arch.to_string());
    for (k, v) in &cfg.labels {
        l.insert(k.clone(), v.clone());
    }
    l
}

fn quantity_ki(bytes: u64) -> String {
    format!("{}Ki", bytes / 1024)
}

/// `(capacity, allocatable)`.
pub fn resources(s: &NodeSample, cfg: &NodeConfig) -> (Value, Value) {
    let cap = json!({
        "cpu": s.cpus.max(1).to_string(),
        "memory": quantity_ki(s.memory_total_bytes),
        "pods": cfg.max_pods.to_string(),
    });
    let alloc = json!({
        "cpu": s.cpus.max(1).to_string(),
        "memory": quantity_ki(s.memory_total_bytes.saturating_sub(cfg.memory_reserve_bytes)),
        "pods": cfg.max_pods.to_string(),
    });
    (cap, alloc)
}

struct Cond {
    kind: &'static str,
    status: bool,
    reason: &'static str,
    message: String,
}

/// The node conditions, keeping each one's `lastTransitionTime` from `prev` while its status
/// is unchanged. The messages are fixed texts, as the kubelet's are: a live figure in them
/// (MiB available, PIDs in use) made every report a change, rewriting the Node in etcd and in
/// edgehub's cache on flash each time (the flash bench found it). No NetworkUnavailable:
/// edgehub's pods use the host network or the runtime's
/// CNI, and that condition belongs to whoever manages routes.
pub fn conditions(s: &NodeSample, cfg: &NodeConfig, prev: Option<&Value>, now: &str) -> Value {
    let mem_low = s.memory_available_bytes < cfg.memory_pressure_bytes;
    let disk_low = s
        .disk_free_percent
        .is_some_and(|f| f < cfg.disk_pressure_percent);
    let pid_high =
        s.pid_max > 0 && s.pids_used * 100 > s.pid_max * u64::from(cfg.pid_pressure_percent);
    let list = [
        match &s.runtime_problem {
            None => Cond {
                kind: "Ready",
                status: true,
                reason: "EdgehubReady",
                message: "edgehub is posting ready status".into(),
            },
            Some(p) => Cond {
                kind: "Ready",
                status: false,
                reason: "ContainerRuntimeNotReady",
                message: format!("container runtime is down: {p}"),
            },
        },
        Cond {
            kind: "MemoryPressure",
            status: mem_low,
            reason: if mem_low {
                "NodeHasInsufficientMemory"
            } else {
                "NodeHasSufficientMemory"
            },
            message: if mem_low {
                "edgehub has insufficient memory available"
            } else {
                "edgehub has sufficient memory available"
            }
            .into(),
        },
        Cond {
            kind: "DiskPressure",
            status: disk_low || s.image_fs_pressure.is_some(),
            reason: if disk_low || s.image_fs_pressure.is_some() {
                "NodeHasDiskPressure"
            } else {
                "NodeHasNoDiskPressure"
            },
            message: match (&s.image_fs_pressure, s.disk_free_percent, disk_low) {
                (Some(why), _, _) => format!("edgehub has disk pressure: {why}"),
                (None, None, _) => "free space unknown".into(),
                (None, Some(_), true) => "edgehub has disk pressure".into(),
                (None, Some(_), false) => "edgehub has no disk pressure".into(),
            },
        },
        Cond {
            kind: "PIDPressure",
            status: pid_high,
            reason: if pid_high {
                "NodeHasInsufficientPID"
            } else {
                "NodeHasSufficientPID"
            },
            message: if pid_high {
                "edgehub has insufficient PID available"
            } else {
                "edgehub has sufficient PID available"
            }
            .into(),
        },
    ];
    let prev_of =
        |kind: &str| -> Option<&Value> { prev?.as_array()?.iter().find(|c| c["type"] == kind) };
    Value::Array(
        list.into_iter()
            .map(|c| {
                let status = if c.status { "True" } else { "False" };
                let since = prev_of(c.kind)
                    .filter(|p| p["status"] == status)
                    .and_then(|p| p["lastTransitionTime"].as_str())
                    .unwrap_or(now)
                    .to_string();
                json!({
                    "type": c.kind,
                    "status": status,
                    "reason": c.reason,
                    "message": c.message,
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": since,
                })
            })
            .collect(),
    )
}

/// The Node's `status`.
pub fn status(
    s: &NodeSample,
    cfg: &NodeConfig,
    node_name: &str,
    prev_conditions: Option<&Value>,
    now: &str,
) -> Value {
    let (cap, alloc) = resources(s, cfg);
    let mut addresses = Vec::new();
    if let Some(ip) = s.internal_ip {
        addresses.push(json!({"type": "InternalIP", "address": ip.to_string()}));
    }
    addresses.push(json!({"type": "Hostname", "address": node_name}));
    json!({
        "capacity": cap,
        "allocatable": alloc,
        "conditions": conditions(s, cfg, prev_conditions, now),
        "addresses": addresses,
        "daemonEndpoints": {"kubeletEndpoint": {"Port": cfg.kubelet_port.unwrap_or(0)}},
        "nodeInfo": {
            "machineID": s.machine_id,
            "systemUUID": s.system_uuid,
            "bootID": s.boot_id,
            "kernelVersion": s.kernel_version,
            "osImage": s.os_image,
            "containerRuntimeVersion": s.container_runtime_version.clone().unwrap_or_default(),
            "kubeletVersion": KUBELET_VERSION,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": s.architecture,
        },
    })
}

fn taints_json(taints: &[Taint]) -> Value {
    Value::Array(
        taints
            .iter()
            .map(|t| json!({"key": t.key, "value": t.value, "effect": t.effect}))
            .collect(),
    )
}

/// The Node to create on first registration (NodeRestriction keeps status set at creation).
pub fn new_node(s: &NodeSample, cfg: &NodeConfig, node_name: &str, now: &str) -> Value {
    let mut spec = Map::new();
    if !cfg.taints.is_empty() {
        spec.insert("taints".into(), taints_json(&cfg.taints));
    }
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node_name,
            "labels": labels(cfg, node_name, &s.architecture),
            "annotations": {MANAGED_BY_ANNOTATION: concat!("edgehub/", env!("CARGO_PKG_VERSION"))},
        },
        "spec": spec,
        "status": status(s, cfg, node_name, None, now),
    })
}

/// The metadata patch that brings an existing Node's labels and annotation to what edgehub
/// registers, or `None` when nothing differs. Taints are set only at creation:
/// NodeRestriction does not let a node change its own taints afterwards.
pub fn reconcile_patch(
    existing: &Value,
    cfg: &NodeConfig,
    node_name: &str,
    arch: &str,
) -> Option<Value> {
    let mut want_labels = Map::new();
    for (k, v) in labels(cfg, node_name, arch) {
        if existing
            .pointer("/metadata/labels")
            .and_then(|l| l.get(&k))
            .and_then(Value::as_str)
            != Some(v.as_str())
        {
            want_labels.insert(k, v.into());
        }
    }
    let managed = concat!("edgehub/", env!("CARGO_PKG_VERSION"));
    let annotation_ok = existing
        .pointer("/metadata/annotations")
        .and_then(|a| a.get(MANAGED_BY_ANNOTATION))
        .and_then(Value::as_str)
        == Some(managed);
    if want_labels.is_empty() && annotation_ok {
        return None;
    }
    let mut meta = Map::new();
    if !want_labels.is_empty() {
        meta.insert("labels".into(), Value::Object(want_labels));
    }
    if !annotation_ok {
        meta.insert(
            "annotations".into(),
            json!({MANAGED_BY_ANNOTATION: managed}),
        );
    }
    Some(json!({"metadata": meta}))
}

/// The Lease body for a create (`resource_version` None) or a conditional replace.
pub fn lease(
    node_name: &str,
    duration_secs: u32,
    renew_time: &str,
    resource_version: Option<&str>,
) -> Value {
    let mut meta = json!({"name": node_name, "namespace": LEASE_NAMESPACE});
    if let Some(rv) = resource_version {
        meta["resourceVersion"] = rv.into();
    }
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": meta,
        "spec": {
            "holderIdentity": node_name,
            "leaseDurationSeconds": duration_secs,
            "renewTime": renew_time,
        },
    })
}

/// The parts of a status whose change warrants a patch before the report interval: everything
/// but the heartbeat times and the free-text messages.
pub(super) fn significant(status: &Value) -> Value {
    let mut s = status.clone();
    if let Some(cs) = s.get_mut("conditions").and_then(Value::as_array_mut) {
        for c in cs {
            if let Some(m) = c.as_object_mut() {
                m.remove("lastHeartbeatTime");
                m.remove("lastTransitionTime");
                m.remove("message");
            }
        }
    }
    s
}

/// Whether someone changed the Node's Ready condition after edgehub last posted it: the
/// cached Node (as the Node's watch last delivered it) carries the heartbeat of that post but
/// another status. That is what the node lifecycle controller does when the Lease goes stale
/// (Ready=Unknown, the kubelet's heartbeat kept); only a new status post undoes it.
///
/// A cached Node with an older heartbeat is one the watch has not yet brought up to the last
/// post: nothing to say about it yet (its next event will). So a link that returns before the
/// controller gave up on the node costs no status post, and one that returns after costs one,
/// as soon as the watch replays the controller's change.
pub fn ready_overridden(cached: &Value, posted_conditions: &Value) -> bool {
    let ready = |conds: &Value| -> Option<(Value, Value)> {
        conds
            .as_array()?
            .iter()
            .find(|c| c["type"] == "Ready")
            .map(|c| (c["status"].clone(), c["lastHeartbeatTime"].clone()))
    };
    let (Some((ours, beat)), Some((theirs, their_beat))) = (
        ready(posted_conditions),
        ready(&cached["status"]["conditions"]),
    ) else {
        return false;
    };
    beat.is_string() && beat == their_beat && ours != theirs
}
