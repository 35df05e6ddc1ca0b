//! A stand-in for the parts of a cluster that `edgehub controller` relies on but does not
//! replace, driven through [`FakeApiServer`]'s public methods:
//!
//! - **Nodes**, Ready or NotReady as a test sets them;
//! - **the DaemonSet controller**: for every DaemonSet and every node without a live
//!   (non-terminating) pod of it, it creates one at the update revision (highest
//!   `.revision` of its ControllerRevisions), shaped as the recorded replacement pod in
//!   `pods_list_after_delete.json`: `generateName`, the template's labels plus
//!   `controller-revision-hash` and `pod-template-generation`, a controlling ownerReference,
//!   the node affinity and tolerations the real controller adds, status Pending;
//! - **the kubelet** of each Ready node: a new pod turns Running and Ready after
//!   `ready_after`; a pod deleted gracefully (with `deletionTimestamp`) is removed after
//!   `terminate_after`. A NotReady node has no kubelet: nothing on it changes.
//!
//! The operator's side is [`seed_daemonset`] and [`roll`]. Revision hashes are made-up
//! strings: nothing may recompute them, so any unique string will do.

use crate::FakeApiServer;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

const HASH_LABEL: &str = "controller-revision-hash";

/// Timings of the simulated cluster.
#[derive(Debug, Clone, Copy)]
pub struct SimConfig {
    /// A new pod on a Ready node turns Ready after this long.
    pub ready_after: Duration,
    /// A pod deleted gracefully on a Ready node is gone after this long.
    pub terminate_after: Duration,
    /// How often the stand-in looks at the cluster.
    pub tick: Duration,
}

impl Default for SimConfig {
    fn default() -> SimConfig {
        SimConfig {
            ready_after: Duration::from_millis(300),
            terminate_after: Duration::from_millis(100),
            tick: Duration::from_millis(20),
        }
    }
}

/// What the stand-in did.
#[derive(Debug, Default)]
pub struct SimStats {
    pub pods_created: AtomicU64,
    pub pods_ready: AtomicU64,
    pub pods_removed: AtomicU64,
}

/// The running stand-in; dropping it stops it.
pub struct DaemonSetSim {
    stop: watch::Sender<bool>,
    pub stats: Arc<SimStats>,
}

impl Drop for DaemonSetSim {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

impl DaemonSetSim {
    pub fn spawn(server: Arc<FakeApiServer>, cfg: SimConfig) -> DaemonSetSim {
        let (stop, mut stop_rx) = watch::channel(false);
        let stats = Arc::new(SimStats::default());
        let st = stats.clone();
        tokio::spawn(async move {
            let mut sim = Sim {
                cfg,
                seen: HashMap::new(),
                terminating_since: HashMap::new(),
                last_rv: u64::MAX,
                next_due: None,
                names: 0,
            };
            loop {
                sim.tick(&server, &st);
                tokio::select! {
                    _ = tokio::time::sleep(cfg.tick) => {}
                    _ = stop_rx.changed() => return,
                }
            }
        });
        DaemonSetSim { stop, stats }
    }
}

struct Sim {
    cfg: SimConfig,
    /// Pod uid → when the stand-in first saw it.
    seen: HashMap<String, Instant>,
    /// Pod uid → when the stand-in first saw it terminating.
    terminating_since: HashMap<String, Instant>,
    last_rv: u64,
    next_due: Option<Instant>,
    names: u64,
}

fn s<'a>(v: &'a Value, p: &str) -> &'a str {
    v.pointer(p).and_then(Value::as_str).unwrap_or("")
}

/// Whether a Node or a pod has condition `Ready` = True.
pub fn is_ready(obj: &Value) -> bool {
    obj.pointer("/status/conditions")
        .and_then(Value::as_array)
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        })
}

/// The uid of the object's controlling owner.
pub fn owner_uid(obj: &Value) -> Option<&str> {
    obj.pointer("/metadata/ownerReferences")?
        .as_array()?
        .iter()
        .find(|o| o["controller"] == true)?
        .get("uid")?
        .as_str()
}

/// The update revision of the DaemonSet with `uid`: its ControllerRevision with the highest
/// `.revision`.
pub fn update_revision(crs: &[Value], uid: &str) -> Option<Value> {
    crs.iter()
        .filter(|c| owner_uid(c) == Some(uid))
        .max_by_key(|c| c["revision"].as_i64().unwrap_or(0))
        .cloned()
}

impl Sim {
    fn tick(&mut self, server: &FakeApiServer, stats: &SimStats) {
        let now = Instant::now();
        let rv = server.resource_version();
        if rv == self.last_rv && self.next_due.is_none_or(|d| now < d) {
            return;
        }
        self.next_due = None;
        let nodes: BTreeMap<String, bool> = server
            .list("nodes")
            .iter()
            .map(|n| (s(n, "/metadata/name").to_string(), is_ready(n)))
            .collect();
        let pods = server.list("pods");
        let due = |at: Instant, next: &mut Option<Instant>| {
            *next = Some(next.map_or(at, |n: Instant| n.min(at)));
        };
        // The kubelets.
        for pod in &pods {
            let uid = s(pod, "/metadata/uid").to_string();
            let first = *self.seen.entry(uid.clone()).or_insert(now);
            let node_ready = nodes
                .get(s(pod, "/spec/nodeName"))
                .copied()
                .unwrap_or(false);
            if !node_ready {
                continue;
            }
            let (ns, name) = (s(pod, "/metadata/namespace"), s(pod, "/metadata/name"));
            if pod.pointer("/metadata/deletionTimestamp").is_some() {
                let since = *self.terminating_since.entry(uid.clone()).or_insert(now);
                if now >= since + self.cfg.terminate_after {
                    server.remove("pods", ns, name);
                    stats.pods_removed.fetch_add(1, Ordering::Relaxed);
                    self.seen.remove(&uid);
                    self.terminating_since.remove(&uid);
                } else {
                    due(since + self.cfg.terminate_after, &mut self.next_due);
                }
            } else if !is_ready(pod) {
                if now >= first + self.cfg.ready_after {
                    server.modify("pods", ns, name, |p| {
                        // As a kubelet does, keep the conditions others own (PodNeedUpgrade).
                        let mut status = running_status(&crate::apiserver::now_rfc3339());
                        let own: Vec<Value> =
                            status["conditions"].as_array().cloned().unwrap_or_default();
                        let foreign = p
                            .pointer("/status/conditions")
                            .and_then(Value::as_array)
                            .cloned()
                            .unwrap_or_default()
                            .into_iter()
                            .filter(|c| !own.iter().any(|o| o["type"] == c["type"]));
                        if let Some(cs) = status["conditions"].as_array_mut() {
                            cs.extend(foreign);
                        }
                        p["status"] = status;
                    });
                    stats.pods_ready.fetch_add(1, Ordering::Relaxed);
                } else {
                    due(first + self.cfg.ready_after, &mut self.next_due);
                }
            }
        }
        // The DaemonSet controller. The list from before the kubelets' changes will do: they
        // only removed terminating pods and made pods Ready, neither of which changes which
        // nodes have a live pod.
        let crs = server.list("controllerrevisions");
        // (DaemonSet uid, node) of every live pod, so a thousand nodes cost one pass.
        let live: std::collections::HashSet<(&str, &str)> = pods
            .iter()
            .filter(|p| p.pointer("/metadata/deletionTimestamp").is_none())
            .filter_map(|p| Some((owner_uid(p)?, s(p, "/spec/nodeName"))))
            .collect();
        for ds in server.list("daemonsets") {
            let uid = s(&ds, "/metadata/uid");
            let Some(cr) = update_revision(&crs, uid) else {
                continue;
            };
            for node in nodes.keys() {
                if !live.contains(&(uid, node.as_str())) {
                    self.names += 1;
                    let pod = pod_for(&ds, &cr, node, &suffix(self.names));
                    server.apply("pods", pod);
                    stats.pods_created.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.last_rv = server.resource_version();
    }
}

/// Five characters from a counter, in the alphabet of the apiserver's generateName
/// suffixes; distinct for the first 27^5 pods.
fn suffix(n: u64) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut n = n;
    (0..5)
        .map(|_| {
            let c = ALPHABET[(n % ALPHABET.len() as u64) as usize] as char;
            n /= ALPHABET.len() as u64;
            c
        })
        .collect()
}

/// The status a kubelet reports for a running, Ready pod.
pub fn running_status(now: &str) -> Value {
    json!({
        "phase": "Running",
        "conditions": [
            {"type": "PodReadyToStartContainers", "status": "True", "lastProbeTime": null, "lastTransitionTime": now},
            {"type": "Initialized", "status": "True", "lastProbeTime": null, "lastTransitionTime": now},
            {"type": "Ready", "status": "True", "lastProbeTime": null, "lastTransitionTime": now},
            {"type": "ContainersReady", "status": "True", "lastProbeTime": null, "lastTransitionTime": now},
            {"type": "PodScheduled", "status": "True", "lastProbeTime": null, "lastTransitionTime": now},
        ],
        "startTime": now,
        "qosClass": "Burstable",
    })
}

/// A pod of `ds` at revision `cr` for `node`, as the DaemonSet controller creates it.
pub fn pod_for(ds: &Value, cr: &Value, node: &str, suffix: &str) -> Value {
    let template = cr
        .pointer("/data/spec/template")
        .cloned()
        .unwrap_or(json!({}));
    let ds_name = s(ds, "/metadata/name");
    let mut labels = template
        .pointer("/metadata/labels")
        .cloned()
        .unwrap_or(json!({}));
    labels[HASH_LABEL] = cr
        .pointer(&format!("/metadata/labels/{HASH_LABEL}"))
        .cloned()
        .unwrap_or(Value::Null);
    labels["pod-template-generation"] = ds
        .pointer("/metadata/annotations/deprecated.daemonset.template.generation")
        .cloned()
        .unwrap_or(json!("1"));
    let mut spec = template.get("spec").cloned().unwrap_or(json!({}));
    spec["nodeName"] = node.into();
    spec["affinity"] = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}});
    spec["tolerations"] = json!([
        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"},
        {"key": "node.kubernetes.io/disk-pressure", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/memory-pressure", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/pid-pressure", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"},
    ]);
    let mut meta = json!({
        "name": format!("{ds_name}-{suffix}"),
        "generateName": format!("{ds_name}-"),
        "namespace": s(ds, "/metadata/namespace"),
        "labels": labels,
        "ownerReferences": [{
            "apiVersion": "apps/v1", "kind": "DaemonSet", "name": ds_name,
            "uid": s(ds, "/metadata/uid"), "controller": true, "blockOwnerDeletion": true,
        }],
    });
    if let Some(a) = template.pointer("/metadata/annotations") {
        meta["annotations"] = a.clone();
    }
    let now = crate::apiserver::now_rfc3339();
    let mut pod = json!({
        "metadata": meta,
        "spec": spec,
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "True", "lastProbeTime": null, "lastTransitionTime": now}],
            "qosClass": "Burstable",
        },
    });
    // The controller POSTs the pod; the apiserver's admission adds the token volume.
    crate::apiserver::admit_service_account(&mut pod);
    pod
}

/// A Node named `name`, Ready or not.
pub fn node(name: &str, ready: bool) -> Value {
    json!({
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}},
        "spec": {},
        "status": {"conditions": [node_ready_condition(ready)]},
    })
}

fn node_ready_condition(ready: bool) -> Value {
    let now = crate::apiserver::now_rfc3339();
    if ready {
        json!({"type": "Ready", "status": "True", "lastHeartbeatTime": now, "lastTransitionTime": now,
               "reason": "KubeletReady", "message": "kubelet is posting ready status"})
    } else {
        json!({"type": "Ready", "status": "Unknown", "lastHeartbeatTime": now, "lastTransitionTime": now,
               "reason": "NodeStatusUnknown", "message": "Kubelet stopped posting node status."})
    }
}

/// Sets a node's Ready condition, as its kubelet (Ready) or the node lifecycle controller
/// (Unknown) would.
pub fn set_node_ready(server: &FakeApiServer, name: &str, ready: bool) {
    server.modify("nodes", "", name, |n| {
        n["status"]["conditions"] = json!([node_ready_condition(ready)]);
    });
}

/// Creates the DaemonSet `ds` (a DaemonSet object, e.g. a recorded one), its first
/// ControllerRevision with hash `hash`, and one Ready pod of it on every node, as a cluster
/// that has been running for a while. Returns the stored DaemonSet.
pub fn seed_daemonset(server: &FakeApiServer, mut ds: Value, hash: &str) -> Value {
    if let Some(m) = ds["metadata"].as_object_mut() {
        m.remove("managedFields");
        m.remove("resourceVersion");
    }
    ds["metadata"]["annotations"]["deprecated.daemonset.template.generation"] = "1".into();
    let ds = server.apply("daemonsets", ds);
    let cr = server.apply("controllerrevisions", revision(&ds, hash, 1));
    let mut n = 0;
    for node in server.list("nodes") {
        n += 1;
        let mut pod = pod_for(&ds, &cr, s(&node, "/metadata/name"), &format!("s{n:04}"));
        pod["status"] = running_status("2026-11-29T18:00:00Z");
        server.apply("pods", pod);
    }
    ds
}

/// A ControllerRevision of `ds` holding its current template.
fn revision(ds: &Value, hash: &str, number: i64) -> Value {
    let name = s(ds, "/metadata/name");
    let mut template = ds.pointer("/spec/template").cloned().unwrap_or(json!({}));
    template["$patch"] = "replace".into();
    let mut labels = ds
        .pointer("/spec/template/metadata/labels")
        .cloned()
        .unwrap_or(json!({}));
    labels[HASH_LABEL] = hash.into();
    json!({
        "metadata": {
            "name": format!("{name}-{hash}"),
            "namespace": s(ds, "/metadata/namespace"),
            "labels": labels,
            "annotations": ds.pointer("/metadata/annotations").cloned().unwrap_or(json!({})),
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "DaemonSet", "name": name,
                "uid": s(ds, "/metadata/uid"), "controller": true, "blockOwnerDeletion": true,
            }],
        },
        "data": {"spec": {"template": template}},
        "revision": number,
    })
}

/// The operator changes the DaemonSet's template with `change`; the DaemonSet controller
/// records the new template as ControllerRevision `hash`, numbered one past the highest.
pub fn roll(
    server: &FakeApiServer,
    namespace: &str,
    name: &str,
    hash: &str,
    change: impl FnOnce(&mut Value),
) -> Value {
    let ds = server.modify("daemonsets", namespace, name, |d| {
        change(&mut d["spec"]["template"]);
        let generation = d["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
        d["metadata"]["generation"] = generation.into();
        d["metadata"]["annotations"]["deprecated.daemonset.template.generation"] =
            generation.to_string().into();
    });
    let crs = server.list("controllerrevisions");
    let next = update_revision(&crs, s(&ds, "/metadata/uid"))
        .and_then(|c| c["revision"].as_i64())
        .unwrap_or(0)
        + 1;
    server.apply("controllerrevisions", revision(&ds, hash, next))
}

/// Sets the image of the template's first container: the usual roll.
pub fn set_image(image: &str) -> impl FnOnce(&mut Value) + '_ {
    move |t| t["spec"]["containers"][0]["image"] = image.into()
}
