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
        },
        revision::Plan::Recreate(because) => UpgradePlan {
            mode: Mode::Recreate,
            changes: Vec::new(),
            recreate_because: because,
            hold_ms,
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
