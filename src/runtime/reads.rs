//! What a pass reads from the store besides the desired pods, kept for as long as the store's
//! generation ([`Store::generation`]: every row any write changed) has not moved.
//!
//! An idle node's passes are its relists (every second) and its probes' (one per probe
//! period and pod), and each read these afresh: six or seven SQLite read transactions a pass,
//! each a pair of `fcntl` locks and a statement, for rows that change when a pod is
//! adopted, deleted, pre-pulled or synced and otherwise never. Read once per generation,
//! an idle pass touches the file not at all.

use crate::store::{Store, StoreError};
use std::collections::{HashMap, HashSet};

/// A sandbox awaiting adoption by its replacement pod, as the store has it: whether it
/// expired depends on the clock too, which [`StoreReads::awaiting`] is asked with.
#[derive(Debug, Clone)]
struct AwaitingRow {
    label_uid: String,
    namespace: String,
    owner_uid: String,
    hash: String,
    /// Since when (boot clock, ms) its pod object is gone from the cache.
    deletion_seen_ms: Option<i64>,
    /// Its DaemonSet is gone from a cache that listed its namespace's DaemonSets.
    daemonset_gone: bool,
}

/// The store's rows a pass decides with, read at one generation.
#[derive(Debug)]
pub(super) struct StoreReads {
    generation: u64,
    /// Label uid -> the pod its CRI objects belong to (adopted sandboxes).
    pub(super) aliases: HashMap<String, String>,
    /// The pod list of this node was synced at least once.
    pub(super) sources_ready: bool,
    /// Per pod uid, the newest revision whose images a pre-pull put on the node.
    pub(super) pulled: HashMap<String, String>,
    awaiting: Vec<AwaitingRow>,
    /// The upgrade uids last asked about, and which of them ended without committing.
    ended: Option<(Vec<String>, HashSet<String>)>,
}

impl StoreReads {
    /// `current` if the store has not changed since it was read, else read again.
    pub(super) fn refresh(
        current: Option<StoreReads>,
        store: &Store,
        node_name: &str,
    ) -> Result<StoreReads, StoreError> {
        // Taken before the reads: a write while they run moves it past this value, and the
        // next pass reads again. The reads' own write (a deletion stamped the first time it
        // is seen) moves it too, once.
        let generation = store.generation();
        if let Some(r) = current.filter(|r| r.generation == generation) {
            return Ok(r);
        }
        let seen = store.deletions_seen(crate::time::boot_ms())?;
        let mut awaiting = Vec::new();
        for r in store.running_revisions()? {
            if r.awaiting_since_ms.is_none() {
                continue;
            }
            let (namespace, owner_uid) = (
                r.namespace.unwrap_or_default(),
                r.owner_uid.unwrap_or_default(),
            );
            let deletion_seen_ms = seen.get(&r.pod_uid).copied();
            let daemonset_gone =
                deletion_seen_ms.is_some() && store.daemonset_gone(&namespace, &owner_uid)?;
            awaiting.push(AwaitingRow {
                label_uid: r.pod_uid,
                namespace,
                owner_uid,
                hash: r.hash,
                deletion_seen_ms,
                daemonset_gone,
            });
        }
        Ok(StoreReads {
            generation,
            aliases: store.pod_aliases()?,
            sources_ready: store
                .cursor(&crate::sync::pods_cursor_key(node_name))?
                .is_some(),
            pulled: store.pulled_revisions()?,
            awaiting,
            ended: None,
        })
    }

    /// Sandboxes awaiting their replacement pod at `now_ms` (boot clock): expired once
    /// `limit_ms` passed since their pod object's deletion was seen, or at once when no
    /// replacement can come (the DaemonSet is gone).
    pub(super) fn awaiting(&self, now_ms: i64, limit_ms: i64) -> Vec<super::decide::Awaiting> {
        self.awaiting
            .iter()
            .map(|r| super::decide::Awaiting {
                label_uid: r.label_uid.clone(),
                namespace: r.namespace.clone(),
                owner_uid: r.owner_uid.clone(),
                hash: r.hash.clone(),
                expired: r
                    .deletion_seen_ms
                    .is_some_and(|s| now_ms - s >= limit_ms || r.daemonset_gone),
            })
            .collect()
    }

    /// Which of `uids` (sorted, deduplicated) ended without committing.
    pub(super) fn ended_without_commit(
        &mut self,
        store: &Store,
        uids: Vec<String>,
    ) -> Result<HashSet<String>, StoreError> {
        if let Some((asked, ended)) = &self.ended {
            if *asked == uids {
                return Ok(ended.clone());
            }
        }
        let refs: Vec<&str> = uids.iter().map(String::as_str).collect();
        let ended = store.ended_without_commit(&refs)?;
        self.ended = Some((uids, ended.clone()));
        Ok(ended)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::OpenMode;

    #[test]
    fn the_rows_are_read_again_after_any_write_and_only_then() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("db"), OpenMode::Normal).unwrap();
        let first = StoreReads::refresh(None, &store, "n").unwrap();
        assert!(first.aliases.is_empty());
        assert!(!first.sources_ready);
        let read_at = first.generation;
        // Nothing written through the store: the same rows, not read again. A row put into
        // the file behind its back (another connection, which the device never has) shows
        // that: a read would see it.
        let other = rusqlite::Connection::open(dir.path().join("db")).unwrap();
        other
            .execute(
                "INSERT INTO pod_aliases (label_uid, pod_uid, since_ms) VALUES ('x', 'y', 0)",
                [],
            )
            .unwrap();
        drop(other);
        let same = StoreReads::refresh(Some(first), &store, "n").unwrap();
        assert_eq!(same.generation, read_at);
        assert!(same.aliases.is_empty(), "read again: {:?}", same.aliases);
        // A write that does not ring the store's change bell (`forget_aliases_of` does not)
        // still moves the generation: `adopt` then `forget_aliases_of`, each seen.
        store.adopt("label", "pod").unwrap();
        let adopted = StoreReads::refresh(Some(same), &store, "n").unwrap();
        assert_ne!(adopted.generation, read_at);
        assert_eq!(
            adopted.aliases.get("label").map(String::as_str),
            Some("pod")
        );
        assert_eq!(adopted.aliases.get("x").map(String::as_str), Some("y"));
        store.forget_aliases_of("pod").unwrap();
        let forgotten = StoreReads::refresh(Some(adopted), &store, "n").unwrap();
        assert!(
            !forgotten.aliases.contains_key("label"),
            "{:?}",
            forgotten.aliases
        );
    }

    #[test]
    fn an_upgrade_outcome_is_asked_again_for_other_uids_and_after_a_write() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("db"), OpenMode::Normal).unwrap();
        let mut r = StoreReads::refresh(None, &store, "n").unwrap();
        assert!(r
            .ended_without_commit(&store, vec!["a".into()])
            .unwrap()
            .is_empty());
        assert_eq!(r.ended.as_ref().map(|(u, _)| u.len()), Some(1));
        r.ended_without_commit(&store, vec!["a".into(), "b".into()])
            .unwrap();
        assert_eq!(r.ended.as_ref().map(|(u, _)| u.len()), Some(2));
        store.adopt("label", "pod").unwrap();
        let r = StoreReads::refresh(Some(r), &store, "n").unwrap();
        assert!(
            r.ended.is_none(),
            "a new generation forgets the answers of the old"
        );
    }
}
