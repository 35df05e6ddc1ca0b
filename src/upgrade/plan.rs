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

/// An in-place upgrade whose pod stopped running while Verified (a reboot stopped its sandbox,
/// and a stopped sandbox cannot run again): it goes on as a recreate of the pod it was going
/// to run, `target_pod` (the pod with the new images), so a new sandbox runs its new revision,
/// init containers first. A recreate plan stays as it is.
pub fn rerun(plan: &UpgradePlan, target_pod: &Value) -> UpgradePlan {
    let mut again = plan.clone();
    if plan.mode == Mode::InPlace {
        again.mode = Mode::Recreate;
        again.recreate_because = vec!["the pod stopped running before the commit".into()];
        again.target_spec = target_pod
            .get("spec")
            .map(crate::pod::running::without_token_volume);
    }
    again
}

/// The images each container runs after the upgrade, for the ones that change.
pub fn images(plan: &UpgradePlan) -> BTreeMap<String, String> {
    plan.changes
        .iter()
        .map(|c| (c.container.clone(), c.to.clone()))
        .collect()
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
    fn an_in_place_upgrade_runs_again_as_a_recreate_of_its_target_pod() {
        let revs = [rev("a", 1, "app:1", "x"), rev("b", 2, "app:2", "x")];
        let p = make(Some("a"), "b", &revs, 0, 2000).unwrap();
        let pod = json!({"metadata": {"name": "p"}, "spec": {
            "volumes": [{"name": "data"}, {"name": "kube-api-access-x1"}],
            "containers": [{"name": "app", "image": "app:2", "volumeMounts": [
                {"name": "data"}, {"name": "kube-api-access-x1"}]}]}});
        let again = rerun(&p, &pod);
        assert_eq!(again.mode, Mode::Recreate);
        assert_eq!(again.hold_ms, p.hold_ms);
        assert_eq!(
            again.target_spec,
            Some(json!({"volumes": [{"name": "data"}],
                "containers": [{"name": "app", "image": "app:2",
                    "volumeMounts": [{"name": "data"}]}]})),
            "the token volume comes back from the pod, not twice"
        );
        // The target, built from it as a recreate's is, is the pod it was going to run.
        let mut target = pod.clone();
        crate::pod::running::recreate_target(&mut target, again.target_spec.as_ref().unwrap(), "b");
        assert_eq!(target["spec"]["containers"][0]["image"], "app:2");
        assert_eq!(target["spec"]["volumes"].as_array().unwrap().len(), 2);
        // A recreate stays one.
        let r = UpgradePlan {
            mode: Mode::Recreate,
            target_spec: Some(json!({"containers": []})),
            ..p.clone()
        };
        assert_eq!(rerun(&r, &pod), r);
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
}
