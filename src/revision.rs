//! Pure decisions about DaemonSet revisions: which revision is the update revision, whether a
//! pod needs an upgrade (`PodNeedUpgrade`), and whether the upgrade can happen in place.
//!
//! Everything here takes values and returns values, so every rule is unit-tested. Unusual
//! input (a pod without the hash label, a DaemonSet without revisions, two revisions with the
//! same number, unparseable revision data) gets a defined answer, never a panic.

use crate::object::REVISION_HASH_LABEL;
use serde_json::Value;

/// The condition type OpenYurt's OTA API uses.
pub const POD_NEED_UPGRADE: &str = "PodNeedUpgrade";
/// The DaemonSet annotation that opts into OTA or AdvancedRollingUpdate.
pub const UPDATE_STRATEGY_ANNOTATION: &str = "apps.openyurt.io/update-strategy";

/// A ControllerRevision of a DaemonSet, reduced to what the decisions need.
#[derive(Debug, Clone, PartialEq)]
pub struct Revision {
    pub name: String,
    /// The `controller-revision-hash` label: never recomputed (it is Go-internal).
    pub hash: String,
    pub number: i64,
    pub created: String,
    /// `data.spec.template` without the `$patch` directive.
    pub template: Value,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RevisionError {
    #[error("ControllerRevision {0} has no controller-revision-hash label")]
    NoHash(String),
    #[error("ControllerRevision {0} has no .revision number")]
    NoNumber(String),
    #[error("ControllerRevision {0} has no data.spec.template")]
    NoTemplate(String),
    #[error("ControllerRevision is not valid JSON: {0}")]
    Json(String),
}

impl Revision {
    /// Reads a ControllerRevision.
    pub fn from_json(cr: &Value) -> Result<Revision, RevisionError> {
        let name = cr
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let hash = cr
            .pointer("/metadata/labels")
            .and_then(|l| l.get(REVISION_HASH_LABEL))
            .and_then(Value::as_str)
            .filter(|h| !h.is_empty())
            .ok_or_else(|| RevisionError::NoHash(name.clone()))?
            .to_string();
        let number = cr
            .get("revision")
            .and_then(Value::as_i64)
            .ok_or_else(|| RevisionError::NoNumber(name.clone()))?;
        let mut template = cr
            .pointer("/data/spec/template")
            .filter(|t| t.is_object())
            .cloned()
            .ok_or_else(|| RevisionError::NoTemplate(name.clone()))?;
        if let Some(m) = template.as_object_mut() {
            m.remove("$patch");
        }
        let created = cr
            .pointer("/metadata/creationTimestamp")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        Ok(Revision {
            name,
            hash,
            number,
            created,
            template,
        })
    }

    pub fn from_raw(raw: &str) -> Result<Revision, RevisionError> {
        let v: Value = serde_json::from_str(raw).map_err(|e| RevisionError::Json(e.to_string()))?;
        Revision::from_json(&v)
    }
}

/// The update revision among a DaemonSet's revisions: the highest `.revision`. Revisions that
/// cannot be read are skipped. Two revisions with the same number (the controller is in the
/// middle of deduplicating) are ordered by creation time, then name, so the answer is stable.
pub fn update_revision(revisions: &[Revision]) -> Option<&Revision> {
    revisions
        .iter()
        .max_by(|a, b| (a.number, &a.created, &a.name).cmp(&(b.number, &b.created, &b.name)))
}

/// The revision a pod runs, by its hash label.
pub fn running_revision<'a>(pod: &Value, revisions: &'a [Revision]) -> Option<&'a Revision> {
    let hash = pod_hash(pod)?;
    revisions.iter().find(|r| r.hash == hash)
}

/// The pod's `controller-revision-hash` label.
pub fn pod_hash(pod: &Value) -> Option<&str> {
    pod.pointer("/metadata/labels")
        .and_then(|l| l.get(REVISION_HASH_LABEL))
        .and_then(Value::as_str)
        .filter(|h| !h.is_empty())
}

/// The pod's controlling owner `(kind, uid)`.
pub fn pod_owner(pod: &Value) -> Option<(&str, &str)> {
    pod.pointer("/metadata/ownerReferences")?
        .as_array()?
        .iter()
        .find(|o| o.get("controller").and_then(Value::as_bool) == Some(true))
        .map(|o| {
            (
                o.get("kind").and_then(Value::as_str).unwrap_or(""),
                o.get("uid").and_then(Value::as_str).unwrap_or(""),
            )
        })
}

/// Which DaemonSet upgrade model the operator chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Ota,
    AdvancedRollingUpdate,
}

/// What the decision needs to know about a pod. The store indexes all of it, so serving
/// `GET /pods` does not parse whole pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PodFacts<'a> {
    /// Kind of the controlling owner.
    pub owner_kind: Option<&'a str>,
    /// The `controller-revision-hash` label.
    pub hash: Option<&'a str>,
    /// `metadata.deletionTimestamp` is set.
    pub terminating: bool,
}

impl<'a> PodFacts<'a> {
    pub fn from_json(pod: &'a Value) -> PodFacts<'a> {
        PodFacts {
            owner_kind: pod_owner(pod).map(|(k, _)| k),
            hash: pod_hash(pod),
            terminating: pod
                .pointer("/metadata/deletionTimestamp")
                .is_some_and(|v| !v.is_null()),
        }
    }
}

/// What the decision needs to know about a DaemonSet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DaemonSetFacts {
    /// From `apps.openyurt.io/update-strategy`, read case-insensitively as OpenYurt does.
    pub strategy: Option<Strategy>,
    /// `spec.updateStrategy.type` is `OnDelete`.
    pub on_delete: bool,
}

impl DaemonSetFacts {
    pub fn from_json(ds: &Value) -> DaemonSetFacts {
        let strategy = ds
            .pointer("/metadata/annotations")
            .and_then(|a| a.get(UPDATE_STRATEGY_ANNOTATION))
            .and_then(Value::as_str)
            .and_then(|v| {
                if v.eq_ignore_ascii_case("ota") {
                    Some(Strategy::Ota)
                } else if v.eq_ignore_ascii_case("advancedrollingupdate") {
                    Some(Strategy::AdvancedRollingUpdate)
                } else {
                    None
                }
            });
        DaemonSetFacts {
            strategy,
            on_delete: ds
                .pointer("/spec/updateStrategy/type")
                .and_then(Value::as_str)
                == Some("OnDelete"),
        }
    }
}

/// Why a pod does or does not need an upgrade. The `reason` strings go into the condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Need {
    /// The pod runs an older revision than the update revision.
    Upgrade {
        target: String,
    },
    /// The pod runs the update revision.
    Latest {
        target: String,
    },
    NotDaemonSetPod {
        owner_kind: Option<String>,
    },
    /// The owning DaemonSet is not in the cache.
    UnknownDaemonSet,
    /// The DaemonSet has no OTA/AdvancedRollingUpdate annotation, or is not OnDelete.
    NotOtaStrategy {
        target: Option<String>,
    },
    /// No readable revision of the DaemonSet is cached.
    NoRevision,
    /// The pod has no `controller-revision-hash` label.
    NoPodHash {
        target: String,
    },
    /// The pod is being deleted.
    Terminating,
}

impl Need {
    pub fn needed(&self) -> bool {
        matches!(self, Need::Upgrade { .. })
    }

    pub fn target(&self) -> Option<&str> {
        match self {
            Need::Upgrade { target } | Need::Latest { target } | Need::NoPodHash { target } => {
                Some(target)
            }
            Need::NotOtaStrategy { target } => target.as_deref(),
            _ => None,
        }
    }

    /// A CamelCase reason for the condition.
    pub fn reason(&self) -> &'static str {
        match self {
            Need::Upgrade { .. } => "NewRevisionAvailable",
            Need::Latest { .. } => "RunningLatestRevision",
            Need::NotDaemonSetPod { .. } => "NotDaemonSetPod",
            Need::UnknownDaemonSet => "DaemonSetNotCached",
            Need::NotOtaStrategy { .. } => "NotOTAStrategy",
            Need::NoRevision => "NoControllerRevision",
            Need::NoPodHash { .. } => "PodHasNoRevisionHash",
            Need::Terminating => "PodTerminating",
        }
    }

    /// The `PodNeedUpgrade` condition, in OpenYurt's form: message
    /// `controllerrevision: <target hash>` whenever the target is known.
    pub fn condition(&self) -> Condition {
        Condition {
            kind: POD_NEED_UPGRADE,
            status: if self.needed() { "True" } else { "False" },
            reason: self.reason(),
            message: self.target().map(|t| format!("controllerrevision: {t}")),
        }
    }
}

/// A pod condition, serialized with its fields in the apiserver's order.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Condition {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub status: &'static str,
    pub reason: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Decides `PodNeedUpgrade` for one pod. `ds` is the owning DaemonSet if cached, and
/// `revisions` are its revisions (by owner uid).
pub fn need_upgrade(pod: &PodFacts, ds: Option<&DaemonSetFacts>, revisions: &[Revision]) -> Need {
    if pod.terminating {
        return Need::Terminating;
    }
    if pod.owner_kind != Some("DaemonSet") {
        return Need::NotDaemonSetPod {
            owner_kind: pod.owner_kind.map(str::to_string),
        };
    }
    let Some(ds) = ds else {
        return Need::UnknownDaemonSet;
    };
    let target = update_revision(revisions).map(|r| r.hash.clone());
    if ds.strategy.is_none() || !ds.on_delete {
        return Need::NotOtaStrategy { target };
    }
    let Some(target) = target else {
        return Need::NoRevision;
    };
    match pod.hash.filter(|h| !h.is_empty()) {
        None => Need::NoPodHash { target },
        Some(h) if h == target => Need::Latest { target },
        Some(_) => Need::Upgrade { target },
    }
}

/// One container whose image changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageChange {
    pub container: String,
    pub init: bool,
    pub from: String,
    pub to: String,
}

/// How a pod gets from its running template to the target template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Nothing in the pod spec changes (metadata may).
    Identical,
    /// Only container images change: swap those containers in the running sandbox.
    InPlace(Vec<ImageChange>),
    /// Anything else: a new sandbox. The strings name what differs.
    Recreate(Vec<String>),
}

/// Compares two pod templates (`{metadata, spec}`). In place is possible when the specs differ
/// only in `containers[*].image` / `initContainers[*].image` (OpenKruise's InPlaceIfPossible);
/// metadata differences never force a recreate.
pub fn plan(running: &Value, target: &Value) -> Plan {
    let (Some(rs), Some(ts)) = (running.get("spec"), target.get("spec")) else {
        return Plan::Recreate(vec!["a template has no spec".into()]);
    };
    let mut changes = Vec::new();
    let mut reasons = Vec::new();
    for (field, init) in [("containers", false), ("initContainers", true)] {
        let empty = Vec::new();
        let rc = rs.get(field).and_then(Value::as_array).unwrap_or(&empty);
        let tc = ts.get(field).and_then(Value::as_array).unwrap_or(&empty);
        let names = |cs: &[Value]| -> Vec<String> {
            cs.iter()
                .map(|c| {
                    c.get("name")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string()
                })
                .collect()
        };
        if names(rc) != names(tc) {
            reasons.push(format!(
                "spec.{field}: the set or order of containers changed"
            ));
            continue;
        }
        for (r, t) in rc.iter().zip(tc) {
            let name = r
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            if without_image(r) != without_image(t) {
                reasons.push(format!(
                    "spec.{field}[{name}]: fields other than image changed"
                ));
                continue;
            }
            let image = |c: &Value| {
                c.get("image")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string()
            };
            if image(r) != image(t) {
                changes.push(ImageChange {
                    container: name,
                    init,
                    from: image(r),
                    to: image(t),
                });
            }
        }
    }
    let other = |s: &Value| {
        let mut s = s.clone();
        if let Some(m) = s.as_object_mut() {
            m.remove("containers");
            m.remove("initContainers");
        }
        s
    };
    if other(rs) != other(ts) {
        let keys = |s: &Value| -> Vec<String> {
            s.as_object()
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default()
        };
        let (ro, to) = (other(rs), other(ts));
        let mut all = keys(&ro);
        all.extend(keys(&to));
        all.sort();
        all.dedup();
        for k in all {
            if ro.get(&k) != to.get(&k) {
                reasons.push(format!("spec.{k} changed"));
            }
        }
    }
    match (reasons.is_empty(), changes.is_empty()) {
        (false, _) => Plan::Recreate(reasons),
        (true, true) => Plan::Identical,
        (true, false) => Plan::InPlace(changes),
    }
}

fn without_image(c: &Value) -> Value {
    let mut c = c.clone();
    if let Some(m) = c.as_object_mut() {
        m.remove("image");
    }
    c
}

#[cfg(test)]
mod tests;
