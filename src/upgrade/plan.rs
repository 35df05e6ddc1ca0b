//! What an upgrade changes, fixed when it starts and kept in the journal: in place (only images
//! differ) or recreate, the containers whose images change, and how long the new containers
//! must hold. Pure: built from the cached pod and its DaemonSet's revisions.

use crate::revision::{self, Revision};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Mode {
    InPlace,
    Recreate,
}

/// One container whose image changes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    pub container: String,
    pub init: bool,
    pub from: String,
    pub to: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UpgradePlan {
    pub mode: Mode,
    pub changes: Vec<Change>,
    /// Why the pod must be recreated, when it must.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recreate_because: Vec<String>,
    /// How long the new containers must run and be ready before the upgrade commits.
    pub hold_ms: u64,
    /// Recreate: the target revision's pod spec (from its ControllerRevision).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_spec: Option<Value>,
}

/// How the pod runs on the device after an upgrade committed (the runtime map): with other
/// images, or with the target revision's spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum RunningAs {
    Images(BTreeMap<String, String>),
    Spec(Value),
}

impl RunningAs {
    /// Applies this to the cached pod, with the revision's hash label.
    pub fn apply(&self, pod: &mut Value, hash: &str) {
        match self {
            RunningAs::Images(images) => apply_images(pod, images, hash),
            RunningAs::Spec(spec) => recreate_target(pod, spec, hash),
        }
    }
}

/// The pod as it runs after a recreate: the cached pod with the target template's spec. What
/// the template does not say and the pod got from elsewhere stays: the node binding, the
/// tolerations and affinity the DaemonSet controller added, and the service-account token
/// volume the admission plugin injected (with its mounts).
pub fn recreate_target(pod: &mut Value, spec: &Value, hash: &str) {
    let old = pod.get("spec").cloned().unwrap_or(Value::Null);
    let mut new = spec.clone();
    if let (Some(n), Some(o)) = (new.as_object_mut(), old.as_object()) {
        for keep in [
            "nodeName",
            "tolerations",
            "affinity",
            "serviceAccountName",
            "serviceAccount",
            "schedulerName",
            "priority",
            "enableServiceLinks",
            "preemptionPolicy",
        ] {
            if let (false, Some(v)) = (n.contains_key(keep), o.get(keep)) {
                n.insert(keep.to_string(), v.clone());
            }
        }
        let token_volumes: Vec<Value> = o
            .get("volumes")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|v| {
                v.get("name")
                    .and_then(Value::as_str)
                    .is_some_and(|n| n.starts_with("kube-api-access-"))
            })
            .cloned()
            .collect();
        let automount = n
            .get("automountServiceAccountToken")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        if automount && !token_volumes.is_empty() {
            let vols = n
                .entry("volumes")
                .or_insert_with(|| Value::Array(Vec::new()));
            if let Some(vols) = vols.as_array_mut() {
                vols.extend(token_volumes.iter().cloned());
            }
            for list in ["containers", "initContainers"] {
                for c in n
                    .get_mut(list)
                    .and_then(Value::as_array_mut)
                    .into_iter()
                    .flatten()
                {
                    let name = c.get("name").cloned();
                    let mount = o
                        .get(list)
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .find(|oc| oc.get("name") == name.as_ref())
                        .and_then(|oc| oc.get("volumeMounts"))
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .filter(|m| {
                            m.get("name")
                                .and_then(Value::as_str)
                                .is_some_and(|n| n.starts_with("kube-api-access-"))
                        })
                        .cloned()
                        .collect::<Vec<_>>();
                    if let Some(cm) = c.as_object_mut() {
                        let mounts = cm
                            .entry("volumeMounts")
                            .or_insert_with(|| Value::Array(Vec::new()));
                        if let Some(mounts) = mounts.as_array_mut() {
                            mounts.extend(mount);
                        }
                    }
                }
            }
        }
    }
    pod["spec"] = new;
    if let Some(labels) = pod
        .pointer_mut("/metadata/labels")
        .and_then(Value::as_object_mut)
    {
        labels.insert(
            crate::object::REVISION_HASH_LABEL.to_string(),
            Value::String(hash.to_string()),
        );
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("the pod runs revision {0}, which is not cached")]
    RunningRevisionUnknown(String),
    #[error("the target revision {0} is not cached")]
    TargetUnknown(String),
    #[error("the pod has no controller-revision-hash label")]
    NoRunningHash,
}

/// The plan from the revision the pod runs (`running_hash`) to `target_hash`.
pub fn make(
    running_hash: Option<&str>,
    target_hash: &str,
    revisions: &[Revision],
    min_ready_secs: i64,
    floor_ms: u64,
) -> Result<UpgradePlan, PlanError> {
    let running_hash = running_hash.ok_or(PlanError::NoRunningHash)?;
    let find = |h: &str| revisions.iter().find(|r| r.hash == h);
    let running = find(running_hash)
        .ok_or_else(|| PlanError::RunningRevisionUnknown(running_hash.to_string()))?;
    let target =
        find(target_hash).ok_or_else(|| PlanError::TargetUnknown(target_hash.to_string()))?;
    let hold_ms = (min_ready_secs.max(0) as u64 * 1000).max(floor_ms);
    Ok(match revision::plan(&running.template, &target.template) {
        revision::Plan::Identical => UpgradePlan {
            mode: Mode::InPlace,
            changes: Vec::new(),
            recreate_because: Vec::new(),
            hold_ms,
            target_spec: None,
        },
        revision::Plan::InPlace(changes) => UpgradePlan {
            mode: Mode::InPlace,
            changes: changes
                .into_iter()
                .map(|c| Change {
                    container: c.container,
                    init: c.init,
                    from: c.from,
                    to: c.to,
                })
                .collect(),
            recreate_because: Vec::new(),
            hold_ms,
            target_spec: None,
        },
        revision::Plan::Recreate(because) => UpgradePlan {
            mode: Mode::Recreate,
            changes: Vec::new(),
            recreate_because: because,
            hold_ms,
            target_spec: target.template.get("spec").cloned(),
        },
    })
}

/// The images each container runs after the upgrade, for the ones that change.
pub fn images(plan: &UpgradePlan) -> BTreeMap<String, String> {
    plan.changes
        .iter()
        .map(|c| (c.container.clone(), c.to.clone()))
        .collect()
}

/// The pod as it runs after the upgrade: the cached pod with the changed containers' images
/// and the target revision's hash label. The runtime and the engine translate this for the
/// CRI; nothing else of the pod changes in place.
pub fn apply_images(pod: &mut Value, images: &BTreeMap<String, String>, hash: &str) {
    for list in ["containers", "initContainers"] {
        if let Some(Value::Array(cs)) = pod.pointer_mut(&format!("/spec/{list}")) {
            for c in cs.iter_mut() {
                let name = c.get("name").and_then(Value::as_str).unwrap_or("");
                if let Some(img) = images.get(name) {
                    c["image"] = Value::String(img.clone());
                }
            }
        }
    }
    if let Some(labels) = pod
        .pointer_mut("/metadata/labels")
        .and_then(Value::as_object_mut)
    {
        labels.insert(
            crate::object::REVISION_HASH_LABEL.to_string(),
            Value::String(hash.to_string()),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rev(hash: &str, n: i64, image: &str, env: &str) -> Revision {
        Revision {
            name: format!("ds-{hash}"),
            hash: hash.into(),
            number: n,
            created: String::new(),
            template: json!({"metadata": {}, "spec": {"containers": [
                {"name": "app", "image": image, "env": [{"name": "E", "value": env}]},
                {"name": "side", "image": "side:1"}]}}),
        }
    }

    #[test]
    fn images_only_is_in_place_anything_else_recreates() {
        let revs = [
            rev("a", 1, "app:1", "x"),
            rev("b", 2, "app:2", "x"),
            rev("c", 3, "app:2", "y"),
        ];
        let p = make(Some("a"), "b", &revs, 0, 2000).unwrap();
        assert_eq!(p.mode, Mode::InPlace);
        assert_eq!(
            p.changes,
            [Change {
                container: "app".into(),
                init: false,
                from: "app:1".into(),
                to: "app:2".into()
            }]
        );
        assert_eq!(p.hold_ms, 2000, "the floor");
        assert_eq!(
            make(Some("a"), "b", &revs, 10, 2000).unwrap().hold_ms,
            10_000
        );
        let p = make(Some("b"), "c", &revs, 0, 0).unwrap();
        assert_eq!(p.mode, Mode::Recreate);
        assert!(!p.recreate_because.is_empty());
        assert_eq!(
            make(Some("z"), "b", &revs, 0, 0),
            Err(PlanError::RunningRevisionUnknown("z".into()))
        );
        assert_eq!(make(None, "b", &revs, 0, 0), Err(PlanError::NoRunningHash));
    }

    #[test]
    fn a_recreated_pod_keeps_its_binding_and_token_volume() {
        let mut pod = json!({"metadata": {"labels": {"controller-revision-hash": "a"}},
            "spec": {"nodeName": "n1", "tolerations": [{"operator": "Exists"}],
                "volumes": [{"name": "kube-api-access-x", "projected": {"sources": []}}],
                "containers": [{"name": "app", "image": "app:1", "env": [{"name": "E", "value": "1"}],
                    "volumeMounts": [{"name": "kube-api-access-x", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}]}]}});
        let spec = json!({"containers": [{"name": "app", "image": "app:1", "env": [{"name": "E", "value": "2"}]}]});
        RunningAs::Spec(spec).apply(&mut pod, "b");
        assert_eq!(pod["spec"]["containers"][0]["env"][0]["value"], "2");
        assert_eq!(pod["spec"]["nodeName"], "n1");
        assert_eq!(pod["spec"]["tolerations"][0]["operator"], "Exists");
        assert_eq!(pod["spec"]["volumes"][0]["name"], "kube-api-access-x");
        assert_eq!(
            pod["spec"]["containers"][0]["volumeMounts"][0]["name"],
            "kube-api-access-x"
        );
        assert_eq!(pod["metadata"]["labels"]["controller-revision-hash"], "b");
        let back: RunningAs = serde_json::from_str(
            &serde_json::to_string(&RunningAs::Images(BTreeMap::new())).unwrap(),
        )
        .unwrap();
        assert_eq!(back, RunningAs::Images(BTreeMap::new()));
    }

    #[test]
    fn the_pod_after_the_upgrade_has_the_new_images_and_hash() {
        let mut pod = json!({"metadata": {"labels": {"controller-revision-hash": "a"}},
            "spec": {"containers": [{"name": "app", "image": "app:1"}, {"name": "side", "image": "side:1"}]}});
        let images = BTreeMap::from([("app".to_string(), "app:2".to_string())]);
        apply_images(&mut pod, &images, "b");
        assert_eq!(pod["spec"]["containers"][0]["image"], "app:2");
        assert_eq!(pod["spec"]["containers"][1]["image"], "side:1");
        assert_eq!(pod["metadata"]["labels"]["controller-revision-hash"], "b");
    }
}
