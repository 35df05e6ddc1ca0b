//! k8s-openapi objects → the plain views [`super::decide`] takes. Reading fields here, once, is
//! cheaper than converting whole pods to JSON on every reconcile; the few rules that already
//! exist for JSON (the strategy annotation, ControllerRevision parsing) are reused as they are,
//! so the cloud and the device read them the same way.

use super::decide::{ConditionView, DaemonSetView, PodView, MAX_UNAVAILABLE_ANNOTATION};
use crate::object::REVISION_HASH_LABEL;
use crate::revision::{self, DaemonSetFacts, Revision, RevisionError, POD_NEED_UPGRADE};
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet};
use k8s_openapi::api::core::v1::{Node, NodeStatus, Pod, PodSpec, PodStatus};
use serde_json::json;

/// Drops what [`pod`] and [`pod_node`] never read before a pod goes into the cache: its
/// containers, volumes and container statuses are most of its size, and a controller over a
/// fleet caches one pod per node per DaemonSet.
pub fn slim_pod(p: &mut Pod) {
    p.metadata.managed_fields = None;
    p.metadata.annotations = None;
    if let Some(spec) = p.spec.as_mut() {
        *spec = PodSpec {
            node_name: spec.node_name.take(),
            affinity: spec.affinity.take(),
            ..PodSpec::default()
        };
    }
    if let Some(status) = p.status.as_mut() {
        *status = PodStatus {
            conditions: status.conditions.take(),
            ..PodStatus::default()
        };
    }
}

/// Keeps only what [`node_ready`] reads: a real Node's status lists every image on it.
pub fn slim_node(n: &mut Node) {
    n.metadata.managed_fields = None;
    n.metadata.annotations = None;
    n.metadata.labels = None;
    n.spec = None;
    if let Some(status) = n.status.as_mut() {
        *status = NodeStatus {
            conditions: status.conditions.take(),
            ..NodeStatus::default()
        };
    }
}

/// The DaemonSet's facts, with the annotation parsed by [`DaemonSetFacts::from_json`].
pub fn daemonset(ds: &DaemonSet) -> DaemonSetView {
    let annotations = ds.metadata.annotations.as_ref();
    let strategy = annotations.and_then(|a| a.get(revision::UPDATE_STRATEGY_ANNOTATION));
    let update_type = ds
        .spec
        .update_strategy
        .as_ref()
        .and_then(|u| u.type_.as_deref());
    let facts = DaemonSetFacts::from_json(&json!({
        "metadata": {"annotations": {revision::UPDATE_STRATEGY_ANNOTATION: strategy}},
        "spec": {"updateStrategy": {"type": update_type}},
    }));
    DaemonSetView {
        facts,
        max_unavailable: annotations
            .and_then(|a| a.get(MAX_UNAVAILABLE_ANNOTATION))
            .cloned(),
        min_ready_seconds: ds.spec.min_ready_seconds.map_or(0, i64::from),
        terminating: ds.metadata.deletion_timestamp.is_some(),
    }
}

/// The uid of the pod's controlling owner, if that is a DaemonSet.
pub fn daemonset_owner(pod: &Pod) -> Option<&str> {
    pod.metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|o| o.controller == Some(true))
        .filter(|o| o.kind == "DaemonSet")
        .map(|o| o.uid.as_str())
}

/// The node a DaemonSet pod is for: `spec.nodeName`, or before binding, the single node its
/// required node affinity names by `metadata.name` (what the DaemonSet controller writes).
pub fn pod_node(pod: &Pod) -> Option<String> {
    let spec = pod.spec.as_ref()?;
    if let Some(n) = spec.node_name.as_ref().filter(|n| !n.is_empty()) {
        return Some(n.clone());
    }
    let terms = &spec
        .affinity
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required_during_scheduling_ignored_during_execution
        .as_ref()?
        .node_selector_terms;
    terms
        .iter()
        .flat_map(|t| t.match_fields.iter().flatten())
        .find(|e| e.key == "metadata.name" && e.operator == "In")
        .and_then(|e| match e.values.as_deref() {
            Some([one]) => Some(one.clone()),
            _ => None,
        })
}

pub fn pod(pod: &Pod) -> PodView {
    let conditions = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or(&[]);
    let ready = conditions.iter().find(|c| c.type_ == "Ready");
    let need = conditions.iter().find(|c| c.type_ == POD_NEED_UPGRADE);
    PodView {
        name: pod.metadata.name.clone().unwrap_or_default(),
        uid: pod.metadata.uid.clone().unwrap_or_default(),
        node: pod_node(pod),
        hash: pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(REVISION_HASH_LABEL))
            .filter(|h| !h.is_empty())
            .cloned(),
        terminating: pod.metadata.deletion_timestamp.is_some(),
        ready: ready.is_some_and(|c| c.status == "True"),
        ready_since: ready
            .and_then(|c| c.last_transition_time.as_ref())
            .map(|t| t.0.as_second()),
        need_upgrade: need.map(|c| ConditionView {
            status: c.status.clone(),
            reason: c.reason.clone(),
            message: c.message.clone(),
        }),
    }
}

/// A node is Ready when its Ready condition is True; Unknown (the node controller's verdict
/// for a node that stopped reporting) and False are not.
pub fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status == "True")
}

/// The owning DaemonSet's uid, if the ControllerRevision has a controlling DaemonSet owner.
pub fn revision_owner(cr: &ControllerRevision) -> Option<&str> {
    cr.metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "DaemonSet")
        .map(|o| o.uid.as_str())
}

/// A ControllerRevision read by [`Revision::from_json`], the device's own parser, so both
/// sides skip the same unreadable revisions and agree on the update revision.
pub fn revision(cr: &ControllerRevision) -> Result<Revision, RevisionError> {
    let v = serde_json::to_value(cr).map_err(|e| RevisionError::Json(e.to_string()))?;
    Revision::from_json(&v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_items(name: &str) -> Vec<serde_json::Value> {
        let path = format!(
            "{}/tests/fixtures/apiserver/{name}.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        v["response"]["body"]["items"].as_array().unwrap().clone()
    }

    #[test]
    fn recorded_pods_read_as_views() {
        let pods: Vec<Pod> = fixture_items("pods_list_after_delete")
            .into_iter()
            .map(|p| serde_json::from_value(p).unwrap())
            .collect();
        let telemetry = pods
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some("telemetry-h6wk8"))
            .unwrap();
        assert_eq!(
            daemonset_owner(telemetry),
            Some("257121fd-7f84-4bb1-825a-ca893be61c31")
        );
        let v = pod(telemetry);
        assert_eq!(v.node.as_deref(), Some("edge-1"));
        assert_eq!(v.hash.as_deref(), Some("69d5fbc7d4"));
        assert!(!v.terminating);
        // The replacement was recorded right after creation: Pending, not Ready.
        assert!(!v.ready);
        // Before binding, the node comes from the affinity the DaemonSet controller writes.
        let mut unbound = telemetry.clone();
        unbound.spec.as_mut().unwrap().node_name = None;
        assert_eq!(pod_node(&unbound).as_deref(), Some("edge-1"));
        // What the cache keeps reads the same, bound or not, at a fraction of the size.
        for p in pods.iter().chain([&unbound]) {
            let mut slim = p.clone();
            slim_pod(&mut slim);
            assert_eq!(pod(&slim), pod(p));
            assert_eq!(pod_node(&slim), pod_node(p));
            assert_eq!(daemonset_owner(&slim), daemonset_owner(p));
            let size = |p: &Pod| serde_json::to_vec(p).unwrap().len();
            assert!(size(&slim) * 3 < size(p), "{} of {}", size(&slim), size(p));
        }
    }

    #[test]
    fn a_recorded_node_reads_the_same_slimmed() {
        let path = format!(
            "{}/tests/fixtures/apiserver/node_get_self.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let node: Node = serde_json::from_value(v["response"]["body"].clone()).unwrap();
        let mut slim = node.clone();
        slim_node(&mut slim);
        assert_eq!(node_ready(&slim), node_ready(&node));
        let mut not_ready = node.clone();
        for c in not_ready
            .status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap()
        {
            if c.type_ == "Ready" {
                c.status = "Unknown".into();
            }
        }
        assert!(node_ready(&node) != node_ready(&not_ready));
        slim_node(&mut not_ready);
        assert!(!node_ready(&not_ready));
    }

    #[test]
    fn recorded_daemonsets_and_revisions_read_as_the_device_reads_them() {
        let dss: Vec<DaemonSet> = fixture_items("daemonsets_list_as_node")
            .into_iter()
            .map(|d| serde_json::from_value(d).unwrap())
            .collect();
        for ds in &dss {
            let json = serde_json::to_value(ds).unwrap();
            assert_eq!(daemonset(ds).facts, DaemonSetFacts::from_json(&json));
        }
        let gateway = dss
            .iter()
            .find(|d| d.metadata.name.as_deref() == Some("gateway"))
            .unwrap();
        let v = daemonset(gateway);
        assert_eq!(
            v.facts.strategy,
            Some(revision::Strategy::AdvancedRollingUpdate)
        );
        assert_eq!(v.max_unavailable.as_deref(), Some("30%"));
        let crs: Vec<ControllerRevision> = fixture_items("controllerrevisions_list_rev2")
            .into_iter()
            .map(|c| serde_json::from_value(c).unwrap())
            .collect();
        let telemetry: Vec<Revision> = crs
            .iter()
            .filter(|c| revision_owner(c) == Some("257121fd-7f84-4bb1-825a-ca893be61c31"))
            .map(|c| revision(c).unwrap())
            .collect();
        assert_eq!(telemetry.len(), 2);
        assert_eq!(
            revision::update_revision(&telemetry).map(|r| r.hash.as_str()),
            Some("55778fbb9f")
        );
    }
}
