//! What the controller has in flight per DaemonSet, between its own deletions and the pod
//! watch catching up with them: client-go's "expectations", plus the nodes that wait for a
//! replacement pod.
//!
//! Without this, a reconcile that runs before the watch has shown the previous wave's
//! deletions would see the same old pods still Ready and delete a second wave on top of the
//! first. A deletion counts as observed once the pod is gone from the cache or carries a
//! `deletionTimestamp`; the decision already treats a terminating pod as unavailable.
//!
//! Pure bookkeeping with explicit times (milliseconds), so it is unit-tested without a clock.

use super::decide::{InFlight, PodView};
use std::collections::{BTreeMap, HashMap};

/// An unobserved deletion is forgotten after this long (client-go's `ExpectationsTimeout`), so
/// a lost watch event cannot stall a DaemonSet for good.
pub const DELETE_TTL_MS: i64 = 5 * 60 * 1000;
/// A node waits this long at most for its replacement pod before it stops holding budget.
pub const REPLACEMENT_TTL_MS: i64 = 10 * 60 * 1000;

#[derive(Debug, Default)]
struct DaemonSetPending {
    /// Pod uid → when its deletion was sent.
    deletes: BTreeMap<String, i64>,
    /// Node → (uid of the pod deleted there, when).
    awaiting: BTreeMap<String, (String, i64)>,
}

/// In-flight deletions of every DaemonSet, keyed by `namespace/name`.
#[derive(Debug, Default)]
pub struct Pending {
    by_ds: HashMap<String, DaemonSetPending>,
}

impl Pending {
    /// Records a deletion about to be sent. Call it before the request, so a reconcile that
    /// races the response still sees it.
    pub fn deleting(&mut self, ds: &str, uid: &str, node: &str, now_ms: i64) {
        let p = self.by_ds.entry(ds.to_string()).or_default();
        p.deletes.insert(uid.to_string(), now_ms);
        p.awaiting
            .insert(node.to_string(), (uid.to_string(), now_ms));
    }

    /// The pod was already gone (404, or 409 on the uid precondition): the deletion is
    /// observed, and the node still waits for its replacement.
    pub fn already_gone(&mut self, ds: &str, uid: &str) {
        if let Some(p) = self.by_ds.get_mut(ds) {
            p.deletes.remove(uid);
        }
    }

    /// The deletion failed and the pod still exists: forget it entirely.
    pub fn failed(&mut self, ds: &str, uid: &str, node: &str) {
        if let Some(p) = self.by_ds.get_mut(ds) {
            p.deletes.remove(uid);
            if p.awaiting.get(node).is_some_and(|(u, _)| u == uid) {
                p.awaiting.remove(node);
            }
        }
    }

    /// The DaemonSet is gone.
    pub fn forget(&mut self, ds: &str) {
        self.by_ds.remove(ds);
    }

    /// Checks the DaemonSet's pods as the cache has them now against what is in flight, drops
    /// what has been observed or has expired, and returns what is left for the decision.
    pub fn observe(&mut self, ds: &str, pods: &[PodView], now_ms: i64) -> InFlight {
        let Some(p) = self.by_ds.get_mut(ds) else {
            return InFlight::default();
        };
        p.deletes.retain(|uid, sent| {
            let live = pods.iter().any(|pod| &pod.uid == uid && !pod.terminating);
            live && now_ms - *sent < DELETE_TTL_MS
        });
        p.awaiting.retain(|node, (uid, sent)| {
            let replaced = pods.iter().any(|pod| {
                pod.node.as_deref() == Some(node.as_str()) && !pod.terminating && &pod.uid != uid
            });
            !replaced && now_ms - *sent < REPLACEMENT_TTL_MS
        });
        let out = InFlight {
            unobserved_deletes: p.deletes.len(),
            awaiting_replacement: p.awaiting.keys().cloned().collect(),
        };
        if p.deletes.is_empty() && p.awaiting.is_empty() {
            self.by_ds.remove(ds);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(uid: &str, node: &str, terminating: bool) -> PodView {
        PodView {
            name: uid.into(),
            uid: uid.into(),
            node: Some(node.into()),
            terminating,
            ..PodView::default()
        }
    }

    #[test]
    fn a_deletion_is_unobserved_until_the_pod_terminates_or_goes() {
        let mut p = Pending::default();
        p.deleting("ns/ds", "a", "n1", 0);
        p.deleting("ns/ds", "b", "n2", 0);
        let live = [pod("a", "n1", false), pod("b", "n2", false)];
        assert_eq!(p.observe("ns/ds", &live, 10).unobserved_deletes, 2);
        let seen = [pod("a", "n1", true)];
        let f = p.observe("ns/ds", &seen, 20);
        assert_eq!(f.unobserved_deletes, 0);
        // Both nodes still wait for their replacement.
        assert_eq!(
            f.awaiting_replacement.into_iter().collect::<Vec<_>>(),
            ["n1", "n2"]
        );
        // Another DaemonSet is unaffected.
        assert_eq!(p.observe("ns/other", &live, 20), InFlight::default());
    }

    #[test]
    fn a_node_stops_waiting_when_a_new_live_pod_appears_on_it() {
        let mut p = Pending::default();
        p.deleting("ns/ds", "a", "n1", 0);
        // The old pod, terminating, does not count as the replacement; a pending new one does.
        let f = p.observe("ns/ds", &[pod("a", "n1", true)], 1);
        assert_eq!(f.awaiting_replacement.len(), 1);
        let f = p.observe("ns/ds", &[pod("a", "n1", true), pod("c", "n1", false)], 2);
        assert_eq!(f, InFlight::default());
        assert!(p.by_ds.is_empty());
    }

    #[test]
    fn everything_expires() {
        let mut p = Pending::default();
        p.deleting("ns/ds", "a", "n1", 0);
        let live = [pod("a", "n1", false)];
        assert_eq!(
            p.observe("ns/ds", &live, DELETE_TTL_MS - 1)
                .unobserved_deletes,
            1
        );
        let f = p.observe("ns/ds", &live, DELETE_TTL_MS);
        assert_eq!(f.unobserved_deletes, 0);
        assert_eq!(f.awaiting_replacement.len(), 1);
        let f = p.observe("ns/ds", &[], REPLACEMENT_TTL_MS);
        assert_eq!(f, InFlight::default());
    }

    #[test]
    fn failed_and_already_gone_deletions() {
        let mut p = Pending::default();
        p.deleting("ns/ds", "a", "n1", 0);
        p.deleting("ns/ds", "b", "n2", 0);
        let live = [pod("a", "n1", false), pod("b", "n2", false)];
        p.failed("ns/ds", "a", "n1");
        p.already_gone("ns/ds", "b");
        let f = p.observe("ns/ds", &live, 1);
        assert_eq!(f.unobserved_deletes, 0);
        assert_eq!(
            f.awaiting_replacement.into_iter().collect::<Vec<_>>(),
            ["n2"]
        );
        p.forget("ns/ds");
        assert_eq!(p.observe("ns/ds", &live, 2), InFlight::default());
    }
}
