//! Read-side views over the store that combine cached objects: a pod's DaemonSet and its
//! revisions, and from them the pod's `PodNeedUpgrade` decision. The decision itself is the
//! pure [`revision::need_upgrade`]; this module only gathers its inputs.

use crate::object::{Kind, ObjectIndex};
use crate::revision::{self, DaemonSetFacts, Need, PodFacts, Revision};
use crate::store::{Store, StoreError};
use std::collections::HashMap;

/// A DaemonSet as the decisions see it.
#[derive(Debug, Clone)]
pub struct DaemonSetView {
    pub facts: DaemonSetFacts,
    /// Readable revisions; unreadable ones are logged and skipped.
    pub revisions: Vec<Revision>,
}

/// Decides `PodNeedUpgrade` for many pods, reading each DaemonSet and its revisions once,
/// and the revisions upgrades committed (a handful of rows) in one query.
pub struct Decider<'s> {
    store: &'s Store,
    daemonsets: HashMap<String, Option<DaemonSetView>>,
    /// Pod uid → the revision hash an upgrade on this device committed; read on first use.
    running: Option<HashMap<String, String>>,
}

impl<'s> Decider<'s> {
    pub fn new(store: &'s Store) -> Decider<'s> {
        Decider {
            store,
            daemonsets: HashMap::new(),
            running: None,
        }
    }

    /// The revision an upgrade on this device committed for the pod `uid`, if any.
    pub fn running_hash(&mut self, uid: &str) -> Result<Option<&str>, StoreError> {
        if self.running.is_none() {
            let rows = self.store.running_revisions()?;
            self.running = Some(rows.into_iter().map(|r| (r.pod_uid, r.hash)).collect());
        }
        Ok(self
            .running
            .as_ref()
            .and_then(|m| m.get(uid))
            .map(String::as_str))
    }

    /// The DaemonSet with `uid`, if cached.
    pub fn daemonset(&mut self, uid: &str) -> Result<Option<&DaemonSetView>, StoreError> {
        if !self.daemonsets.contains_key(uid) {
            let view = load_daemonset(self.store, uid)?;
            self.daemonsets.insert(uid.to_string(), view);
        }
        Ok(self.daemonsets.get(uid).and_then(Option::as_ref))
    }

    /// The decision for a cached pod, from its index alone.
    pub fn decide(&mut self, pod: &ObjectIndex) -> Result<Need, StoreError> {
        // What the device runs is the truth: an upgrade committed here counts before the
        // cloud has heard of it.
        let running = self.running_hash(&pod.uid)?.map(str::to_string);
        let facts = PodFacts {
            owner_kind: pod.owner_kind.as_deref(),
            hash: running.as_deref().or(pod.revision_hash.as_deref()),
            terminating: pod.deleting,
        };
        let ds = match (&pod.owner_kind, &pod.owner_uid) {
            (Some(k), Some(uid)) if k == "DaemonSet" => self.daemonset(uid)?,
            _ => None,
        };
        Ok(revision::need_upgrade(
            &facts,
            ds.map(|d| &d.facts),
            ds.map(|d| d.revisions.as_slice()).unwrap_or(&[]),
        ))
    }
}

fn load_daemonset(store: &Store, uid: &str) -> Result<Option<DaemonSetView>, StoreError> {
    let Some(ds) = store.get_by_uid(Kind::DaemonSet, uid)? else {
        return Ok(None);
    };
    let facts = match serde_json::from_str(&ds.raw) {
        Ok(v) => DaemonSetFacts::from_json(&v),
        Err(e) => {
            tracing::warn!(daemonset = %ds.index.name, error = %e, "cached DaemonSet is not valid JSON");
            return Ok(None);
        }
    };
    let mut revisions = Vec::new();
    for cr in store.list_owned(Kind::ControllerRevision, uid)? {
        match Revision::from_raw(&cr.raw) {
            Ok(r) => revisions.push(r),
            Err(e) => {
                tracing::warn!(revision = %cr.index.name, error = %e, "skipping unreadable ControllerRevision")
            }
        }
    }
    Ok(Some(DaemonSetView { facts, revisions }))
}
