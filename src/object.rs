//! The indexed view of a Kubernetes object.
//!
//! The cache keeps every object as the raw JSON the apiserver sent. Beside it go a few columns
//! the rest of the program queries by; this module pulls them out of the raw JSON without
//! deserializing the whole object (a Pod is ~10 KB, we need ~200 bytes of it).

use serde::Deserialize;
use std::collections::BTreeMap;

/// The label the DaemonSet controller puts on pods and ControllerRevisions.
pub const REVISION_HASH_LABEL: &str = "controller-revision-hash";

/// The kinds edgehub caches. Keeping this a closed enum makes "which kinds exist" a compile-time
/// fact for the store and the reflectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Pod,
    DaemonSet,
    ControllerRevision,
    Node,
}

impl Kind {
    pub const ALL: [Kind; 4] = [
        Kind::Pod,
        Kind::DaemonSet,
        Kind::ControllerRevision,
        Kind::Node,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::DaemonSet => "DaemonSet",
            Kind::ControllerRevision => "ControllerRevision",
            Kind::Node => "Node",
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The columns the store indexes an object by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectIndex {
    pub kind: Kind,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub resource_version: String,
    /// uid of the controlling owner (`ownerReferences[controller=true]`), if any.
    pub owner_uid: Option<String>,
    /// kind of the controlling owner, if any.
    pub owner_kind: Option<String>,
    /// `controller-revision-hash` label, if any.
    pub revision_hash: Option<String>,
    /// `.revision` of a ControllerRevision.
    pub revision: Option<i64>,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("object is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("object has no metadata.{0}")]
    Missing(&'static str),
}

#[derive(Deserialize)]
struct Partial {
    #[serde(default)]
    metadata: Meta,
    #[serde(default)]
    revision: Option<i64>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Meta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    owner_references: Vec<OwnerRef>,
    #[serde(default)]
    deletion_timestamp: Option<String>,
}

#[derive(Deserialize)]
struct OwnerRef {
    #[serde(default)]
    kind: String,
    #[serde(default)]
    uid: String,
    #[serde(default)]
    controller: bool,
}

impl ObjectIndex {
    /// Extracts the index of a raw object. `kind` comes from the caller because items of a
    /// list response carry no `kind` of their own.
    pub fn from_raw(kind: Kind, raw: &str) -> Result<ObjectIndex, ObjectError> {
        let p: Partial = serde_json::from_str(raw)?;
        let m = p.metadata;
        let owner = m.owner_references.into_iter().find(|o| o.controller);
        Ok(ObjectIndex {
            kind,
            namespace: m.namespace.unwrap_or_default(),
            name: m
                .name
                .filter(|n| !n.is_empty())
                .ok_or(ObjectError::Missing("name"))?,
            uid: m
                .uid
                .filter(|u| !u.is_empty())
                .ok_or(ObjectError::Missing("uid"))?,
            resource_version: m
                .resource_version
                .filter(|r| !r.is_empty())
                .ok_or(ObjectError::Missing("resourceVersion"))?,
            owner_uid: owner.as_ref().map(|o| o.uid.clone()),
            owner_kind: owner.map(|o| o.kind),
            revision_hash: m.labels.get(REVISION_HASH_LABEL).cloned(),
            revision: if kind == Kind::ControllerRevision {
                p.revision
            } else {
                None
            },
            deleting: m.deletion_timestamp.is_some(),
        })
    }
}

/// Whether two versions of a Node differ only in what its agent's heartbeat moves:
/// `metadata.resourceVersion`, `metadata.managedFields` and each condition's
/// `lastHeartbeatTime`. Such a change is not stored: DESIGN §4 keeps heartbeat times off the
/// flash, and edgehub's own status report every few minutes would otherwise rewrite its Node
/// (several pages, the largest steady-state write the flash bench found). Anything else
/// (labels, taints, a condition's status or transition, addresses) is a change. Unparsable
/// JSON is a change.
pub fn node_heartbeat_only(old: &str, new: &str) -> bool {
    fn stable(raw: &str) -> Option<serde_json::Value> {
        let mut v: serde_json::Value = serde_json::from_str(raw).ok()?;
        if let Some(m) = v.get_mut("metadata").and_then(|m| m.as_object_mut()) {
            m.remove("resourceVersion");
            m.remove("managedFields");
        }
        if let Some(conds) = v
            .pointer_mut("/status/conditions")
            .and_then(|c| c.as_array_mut())
        {
            for c in conds.iter_mut().filter_map(|c| c.as_object_mut()) {
                c.remove("lastHeartbeatTime");
            }
        }
        Some(v)
    }
    match (stable(old), stable(new)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node_with(rv: &str, heartbeat: &str, ready: &str, label: &str) -> String {
        serde_json::json!({
            "kind": "Node",
            "metadata": {"name": "edge-1", "uid": "n1", "resourceVersion": rv,
                "labels": {"site": label},
                "managedFields": [{"manager": "edgehub", "time": heartbeat}]},
            "status": {"conditions": [{"type": "Ready", "status": ready,
                "lastHeartbeatTime": heartbeat, "lastTransitionTime": "2026-11-30T10:00:00Z"}]}
        })
        .to_string()
    }

    #[test]
    fn a_node_heartbeat_alone_is_no_change() {
        let old = node_with("10", "2026-12-01T06:00:00Z", "True", "a");
        let beat = node_with("11", "2026-12-01T06:05:00Z", "True", "a");
        assert!(node_heartbeat_only(&old, &beat));
        assert!(!node_heartbeat_only(
            &old,
            &node_with("11", "2026-12-01T06:05:00Z", "False", "a")
        ));
        assert!(!node_heartbeat_only(
            &old,
            &node_with("11", "2026-12-01T06:05:00Z", "True", "b")
        ));
        assert!(!node_heartbeat_only(&old, "{not json"));
        let recorded = include_str!("../tests/fixtures/apiserver/node_get_self.json");
        let body = serde_json::from_str::<serde_json::Value>(recorded).unwrap()["response"]["body"]
            .to_string();
        assert!(node_heartbeat_only(&body, &body));
    }

    #[test]
    fn indexes_a_daemonset_pod() {
        let raw = r#"{"metadata":{"name":"telemetry-sv74m","namespace":"vehicle","uid":"u1",
            "resourceVersion":"251","labels":{"controller-revision-hash":"6d7b9c8f5"},
            "ownerReferences":[{"apiVersion":"apps/v1","kind":"DaemonSet","name":"telemetry",
            "uid":"ds1","controller":true}]},"spec":{}}"#;
        let ix = ObjectIndex::from_raw(Kind::Pod, raw).unwrap();
        assert_eq!(ix.name, "telemetry-sv74m");
        assert_eq!(ix.namespace, "vehicle");
        assert_eq!(ix.owner_uid.as_deref(), Some("ds1"));
        assert_eq!(ix.owner_kind.as_deref(), Some("DaemonSet"));
        assert_eq!(ix.revision_hash.as_deref(), Some("6d7b9c8f5"));
        assert_eq!(ix.revision, None);
    }

    #[test]
    fn revision_only_for_controller_revisions() {
        let raw = r#"{"metadata":{"name":"a","uid":"u","resourceVersion":"1"},"revision":3}"#;
        assert_eq!(
            ObjectIndex::from_raw(Kind::ControllerRevision, raw)
                .unwrap()
                .revision,
            Some(3)
        );
        assert_eq!(
            ObjectIndex::from_raw(Kind::Pod, raw).unwrap().revision,
            None
        );
    }

    #[test]
    fn non_controller_owner_is_ignored() {
        let raw = r#"{"metadata":{"name":"a","uid":"u","resourceVersion":"1",
            "ownerReferences":[{"kind":"Foo","uid":"x"}]}}"#;
        assert_eq!(
            ObjectIndex::from_raw(Kind::Pod, raw).unwrap().owner_uid,
            None
        );
    }

    #[test]
    fn missing_fields_are_errors_not_panics() {
        for raw in [
            "{}",
            r#"{"metadata":{"uid":"u","resourceVersion":"1"}}"#,
            r#"{"metadata":{"name":"a","resourceVersion":"1"}}"#,
            r#"{"metadata":{"name":"a","uid":"u"}}"#,
            r#"{"metadata":{"name":"","uid":"u","resourceVersion":"1"}}"#,
            "[1,2]",
            "not json",
            r#"{"metadata":{"name":5}}"#,
        ] {
            assert!(ObjectIndex::from_raw(Kind::Pod, raw).is_err(), "{raw}");
        }
    }

    #[test]
    fn kind_round_trips() {
        for k in Kind::ALL {
            assert_eq!(Kind::parse(k.as_str()), Some(k));
        }
        assert_eq!(Kind::parse("Secret"), None);
    }
}
