//! The upgrade journal: compare-and-set transitions of a request row, each committed (with
//! what it reports: Events, the revision the pod now runs) in one transaction before the side
//! effect it describes; the log of transitions; and the runtime map of revisions a pod runs
//! on the device.

use super::requests::{row, RequestRecord, COLUMNS};
use super::{outbox, QueuedEvent, StoreError};
use rusqlite::{params, Connection, OptionalExtension};
use std::collections::HashMap;

/// What a transition writes besides the row, in the same transaction.
#[derive(Debug, Clone, Default)]
pub struct Effects {
    pub events: Vec<QueuedEvent>,
    /// The pod now runs this revision on the device.
    pub running: Option<RunningRevision>,
    /// The plan, fixed when the upgrade starts.
    pub plan: Option<String>,
    /// The request's transaction rolls back for this reason, if no decision stands yet (a
    /// member that fails takes the others with it, in the same write).
    pub txn_rollback: Option<String>,
}

/// The revision a pod runs on the device, and the images that differ from its cached pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningRevision {
    pub pod_uid: String,
    pub hash: String,
    /// How the pod runs: `pod::running::RunningAs` as JSON (the images or the spec).
    pub images: String,
    pub committed_ms: i64,
    pub namespace: Option<String>,
    /// The pod's DaemonSet, whose replacement pod adopts the running sandbox.
    pub owner_uid: Option<String>,
    /// Since when the pod object has been deleted, awaiting its replacement (unix ms).
    pub awaiting_since_ms: Option<i64>,
}

/// One line of an upgrade's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    pub state: String,
    pub at_ms: i64,
    pub detail: Option<String>,
}

/// Moves request `id` from `from` to `to` if it is still in `from`; returns whether it did.
/// The new state's deadline replaces the old one and the readiness mark is cleared.
#[allow(clippy::too_many_arguments)]
pub fn transition(
    conn: &mut Connection,
    id: i64,
    from: &str,
    to: &str,
    error: Option<&str>,
    deadline_ms: Option<i64>,
    effects: &Effects,
    now_ms: i64,
) -> Result<bool, StoreError> {
    let tx = conn.transaction()?;
    let n = tx
        .prepare_cached(
            "UPDATE requests SET state = ?3, error = COALESCE(?4, error), deadline_ms = ?5,
                 ready_since_ms = NULL, plan = COALESCE(?6, plan), updated_ms = ?7,
                 clock_boot = ?8, waiting = NULL
             WHERE id = ?1 AND state = ?2 AND NOT (?3 IN ('RollingBack', 'RolledBack') AND EXISTS (
                 SELECT 1 FROM transaction_members m JOIN transactions t ON t.id = m.txn
                 WHERE m.request_id = ?1 AND t.decision = 'commit'))",
        )?
        .execute(params![
            id,
            from,
            to,
            error,
            deadline_ms,
            effects.plan,
            now_ms,
            crate::time::boot_id()
        ])?;
    // Not moved: another writer moved it first, or it is a member of a committed transaction,
    // which never rolls back (the manager was told it committed).
    if n == 0 {
        return Ok(false);
    }
    if let Some(reason) = &effects.txn_rollback {
        tx.prepare_cached(
            "UPDATE transactions SET decision = 'rollback', reason = ?2, updated_ms = ?3
             WHERE decision IS NULL AND id = (
                 SELECT txn FROM transaction_members WHERE request_id = ?1)",
        )?
        .execute(params![id, reason, now_ms])?;
    }
    let seq: i64 = tx
        .prepare_cached("SELECT COALESCE(MAX(seq), 0) + 1 FROM request_log WHERE request_id = ?1")?
        .query_row(params![id], |r| r.get(0))?;
    tx.prepare_cached(
        "INSERT INTO request_log (request_id, seq, state, at_ms, detail) VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute(params![id, seq, to, now_ms, error])?;
    for e in &effects.events {
        outbox::queue_event(&tx, e, now_ms)?;
    }
    if let Some(r) = &effects.running {
        tx.prepare_cached(
            "INSERT INTO running_revisions (pod_uid, hash, images, committed_ms, namespace, owner_uid)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)
             ON CONFLICT (pod_uid) DO UPDATE SET hash = excluded.hash, images = excluded.images,
                 committed_ms = excluded.committed_ms, namespace = excluded.namespace,
                 owner_uid = excluded.owner_uid, awaiting_since_ms = NULL",
        )?
        .execute(params![
            r.pod_uid,
            r.hash,
            r.images,
            r.committed_ms,
            r.namespace,
            r.owner_uid
        ])?;
    }
    if super::requests::TERMINAL_STATES.contains(&to) {
        let (pod, kind): (String, String) = tx
            .prepare_cached("SELECT pod_uid, kind FROM requests WHERE id = ?1")?
            .query_row(params![id], |r| Ok((r.get(0)?, r.get(1)?)))?;
        super::requests::prune(&tx, &pod, &kind)?;
    }
    tx.commit()?;
    Ok(true)
}

/// Records since when the new containers have been ready (boot clock), if the request is still
/// in `state` and its points are on this boot's clock.
pub fn set_ready_since(
    conn: &Connection,
    id: i64,
    state: &str,
    since: Option<i64>,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "UPDATE requests SET ready_since_ms = ?3 WHERE id = ?1 AND state = ?2 AND clock_boot = ?4",
    )?
    .execute(params![id, state, since, crate::time::boot_id()])?;
    Ok(())
}

pub fn get(conn: &Connection, id: i64) -> Result<Option<RequestRecord>, StoreError> {
    Ok(conn
        .prepare_cached(&format!("SELECT {COLUMNS} FROM requests WHERE id = ?1"))?
        .query_row(params![id], row)
        .optional()?)
}

pub fn log(conn: &Connection, id: i64) -> Result<Vec<LogLine>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT state, at_ms, detail FROM request_log WHERE request_id = ?1 ORDER BY seq",
    )?;
    let rows = stmt.query_map(params![id], |r| {
        Ok(LogLine {
            state: r.get(0)?,
            at_ms: r.get(1)?,
            detail: r.get(2)?,
        })
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// A `running_revisions` row, selected as (pod_uid, hash, images, committed_ms, namespace,
/// owner_uid, awaiting_since_ms).
fn running_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<RunningRevision> {
    Ok(RunningRevision {
        pod_uid: r.get(0)?,
        hash: r.get(1)?,
        images: r.get(2)?,
        committed_ms: r.get(3)?,
        namespace: r.get(4)?,
        owner_uid: r.get(5)?,
        awaiting_since_ms: r.get(6)?,
    })
}

pub fn running_revision(
    conn: &Connection,
    pod_uid: &str,
) -> Result<Option<RunningRevision>, StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT pod_uid, hash, images, committed_ms, namespace, owner_uid, awaiting_since_ms FROM running_revisions WHERE pod_uid = ?1",
        )?
        .query_row(params![pod_uid], running_row)
        .optional()?)
}

pub fn running_revisions(conn: &Connection) -> Result<Vec<RunningRevision>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT pod_uid, hash, images, committed_ms, namespace, owner_uid, awaiting_since_ms FROM running_revisions ORDER BY pod_uid",
    )?;
    let rows = stmt.query_map([], running_row)?;
    Ok(rows.collect::<Result<_, _>>()?)
}

pub fn forget_running_revision(conn: &Connection, pod_uid: &str) -> Result<(), StoreError> {
    conn.prepare_cached("DELETE FROM running_revisions WHERE pod_uid = ?1")?
        .execute(params![pod_uid])?;
    conn.prepare_cached("DELETE FROM deletions_seen WHERE pod_uid = ?1")?
        .execute(params![pod_uid])?;
    Ok(())
}

/// For each pod, the newest revision whose images an image-pull request put on the node.
pub fn pulled(conn: &Connection) -> Result<Vec<(String, String)>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT pod_uid, to_hash FROM requests r WHERE kind = 'imagepull' AND state = 'Done'
         AND id = (SELECT MAX(id) FROM requests WHERE pod_uid = r.pod_uid AND kind = 'imagepull')",
    )?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// Whether an image-pull request for this pod and revision exists, in any state.
pub fn pull_requested(conn: &Connection, pod_uid: &str, to_hash: &str) -> Result<bool, StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT 1 FROM requests WHERE kind = 'imagepull' AND pod_uid = ?1 AND to_hash = ?2 LIMIT 1",
        )?
        .query_row(params![pod_uid, to_hash], |_| Ok(()))
        .optional()?
        .is_some())
}

/// The pod object of a running revision was deleted for its replacement to adopt the sandbox.
pub fn mark_awaiting(conn: &Connection, pod_uid: &str, now_ms: i64) -> Result<(), StoreError> {
    conn.prepare_cached(
        "UPDATE running_revisions SET awaiting_since_ms = ?2 WHERE pod_uid = ?1 AND awaiting_since_ms IS NULL",
    )?
    .execute(params![pod_uid, now_ms])?;
    Ok(())
}

/// For each sandbox awaiting adoption whose pod object the cache no longer holds: since when
/// that is so, on the boot clock (stamped `now_ms` of [`crate::time::boot_ms`] the first time
/// it is seen, and again after a reboot, when how long it has been is unknown); the records of
/// sandboxes no longer awaiting go. Writes only when something changed: the runtime asks on
/// every pass.
pub fn deletions_seen(
    conn: &Connection,
    now_ms: i64,
) -> Result<std::collections::HashMap<String, i64>, StoreError> {
    let boot = crate::time::boot_id();
    conn.prepare_cached("UPDATE deletions_seen SET seen_ms = ?1, boot = ?2 WHERE boot <> ?2")?
        .execute(params![now_ms, boot])?;
    let stale: bool = conn
        .prepare_cached(
            "SELECT EXISTS (SELECT 1 FROM running_revisions r WHERE awaiting_since_ms IS NOT NULL
                 AND NOT EXISTS (SELECT 1 FROM objects WHERE kind = 'Pod' AND uid = r.pod_uid)
                 AND NOT EXISTS (SELECT 1 FROM deletions_seen WHERE pod_uid = r.pod_uid))
             OR EXISTS (SELECT 1 FROM deletions_seen d WHERE NOT EXISTS (
                 SELECT 1 FROM running_revisions WHERE pod_uid = d.pod_uid
                     AND awaiting_since_ms IS NOT NULL))",
        )?
        .query_row([], |r| r.get(0))?;
    if stale {
        conn.prepare_cached(
            "INSERT OR IGNORE INTO deletions_seen (pod_uid, seen_ms, boot)
             SELECT pod_uid, ?1, ?2 FROM running_revisions r WHERE awaiting_since_ms IS NOT NULL
                 AND NOT EXISTS (SELECT 1 FROM objects WHERE kind = 'Pod' AND uid = r.pod_uid)",
        )?
        .execute(params![now_ms, boot])?;
        conn.prepare_cached(
            "DELETE FROM deletions_seen WHERE pod_uid NOT IN (
                 SELECT pod_uid FROM running_revisions WHERE awaiting_since_ms IS NOT NULL)",
        )?
        .execute([])?;
    }
    let mut stmt = conn.prepare_cached("SELECT pod_uid, seen_ms FROM deletions_seen")?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// Whether DaemonSet `owner_uid` is gone from a cache that has listed the DaemonSets of
/// `namespace` (a cursor says so): deleted, so nothing will replace the pod objects it owned.
/// A cache still filling (a new file, `--reset-cache`) says nothing.
pub fn daemonset_gone(
    conn: &Connection,
    namespace: &str,
    owner_uid: &str,
) -> Result<bool, StoreError> {
    let all = crate::kube::resource::DAEMONSETS.qualified();
    let one = format!("{all}@{namespace}");
    Ok(conn
        .prepare_cached(
            "SELECT NOT EXISTS (SELECT 1 FROM objects WHERE kind = 'DaemonSet' AND uid = ?1)
                 AND EXISTS (SELECT 1 FROM sync_cursors WHERE resource IN (?2, ?3))",
        )?
        .query_row(params![owner_uid, all, one], |r| r.get(0))?)
}

/// Takes back [`mark_awaiting`] when the deletion it was made for did not happen.
pub fn unmark_awaiting(conn: &Connection, pod_uid: &str) -> Result<(), StoreError> {
    conn.prepare_cached(
        "UPDATE running_revisions SET awaiting_since_ms = NULL WHERE pod_uid = ?1",
    )?
    .execute(params![pod_uid])?;
    Ok(())
}

/// Binds pod `pod_uid` to the sandbox and containers labelled `label_uid`, and closes the
/// running revision of `label_uid` (the replacement runs that revision natively). One
/// transaction.
pub fn adopt(
    conn: &mut Connection,
    label_uid: &str,
    pod_uid: &str,
    now_ms: i64,
) -> Result<(), StoreError> {
    let tx = conn.transaction()?;
    tx.prepare_cached(
        "INSERT INTO pod_aliases (label_uid, pod_uid, since_ms) VALUES (?1, ?2, ?3)
         ON CONFLICT (label_uid) DO UPDATE SET pod_uid = excluded.pod_uid, since_ms = excluded.since_ms",
    )?
    .execute(params![label_uid, pod_uid, now_ms])?;
    // Objects adopted before by the pod now replaced follow it too.
    tx.prepare_cached("UPDATE pod_aliases SET pod_uid = ?2 WHERE pod_uid = ?1")?
        .execute(params![label_uid, pod_uid])?;
    tx.prepare_cached("DELETE FROM running_revisions WHERE pod_uid = ?1")?
        .execute(params![label_uid])?;
    tx.prepare_cached("DELETE FROM deletions_seen WHERE pod_uid = ?1")?
        .execute(params![label_uid])?;
    tx.commit()?;
    Ok(())
}

/// Label uid -> the pod uid its CRI objects belong to.
pub fn aliases(conn: &Connection) -> Result<Vec<(String, String)>, StoreError> {
    let mut stmt = conn.prepare_cached("SELECT label_uid, pod_uid FROM pod_aliases")?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// Forgets the aliases that bind CRI objects to pod `pod_uid` (its sandbox is gone).
pub fn forget_aliases_of(conn: &Connection, pod_uid: &str) -> Result<(), StoreError> {
    conn.prepare_cached("DELETE FROM pod_aliases WHERE pod_uid = ?1")?
        .execute(params![pod_uid])?;
    Ok(())
}

impl super::Store {
    /// Moves request `id` from state `from` to `to` if it is still in `from` (a compare-and-set,
    /// so the API and the engine never race), with what the transition reports, in one
    /// transaction. Returns whether it moved.
    #[allow(clippy::too_many_arguments)]
    pub fn transition(
        &self,
        id: i64,
        from: &str,
        to: &str,
        error: Option<&str>,
        deadline_ms: Option<i64>,
        effects: &Effects,
    ) -> Result<bool, StoreError> {
        let moved = transition(
            &mut self.conn(),
            id,
            from,
            to,
            error,
            deadline_ms,
            effects,
            crate::time::now_ms(),
        )?;
        if moved {
            if !effects.events.is_empty() {
                self.report_queued();
            }
            if effects.running.is_some() || effects.txn_rollback.is_some() {
                self.notify();
            }
        }
        Ok(moved)
    }

    pub fn set_ready_since(
        &self,
        id: i64,
        state: &str,
        since: Option<i64>,
    ) -> Result<(), StoreError> {
        set_ready_since(&self.conn(), id, state, since)
    }

    pub fn request(&self, id: i64) -> Result<Option<RequestRecord>, StoreError> {
        get(&self.conn(), id)
    }

    /// The transitions of request `id`, oldest first.
    pub fn request_log(&self, id: i64) -> Result<Vec<LogLine>, StoreError> {
        log(&self.conn(), id)
    }

    /// The revision a pod runs on the device, when an upgrade committed one its cached pod
    /// object does not have yet.
    pub fn running_revision(&self, pod_uid: &str) -> Result<Option<RunningRevision>, StoreError> {
        running_revision(&self.conn(), pod_uid)
    }

    pub fn running_revisions(&self) -> Result<Vec<RunningRevision>, StoreError> {
        running_revisions(&self.conn())
    }

    /// Per pod uid, the newest revision whose images a pre-pull put on the node.
    pub fn pulled_revisions(&self) -> Result<HashMap<String, String>, StoreError> {
        Ok(pulled(&self.conn())?.into_iter().collect())
    }

    /// Whether a pre-pull of this pod's revision was ever requested.
    pub fn pull_requested(&self, pod_uid: &str, to_hash: &str) -> Result<bool, StoreError> {
        pull_requested(&self.conn(), pod_uid, to_hash)
    }

    /// The pod object of a running revision was deleted so that its replacement adopts it.
    pub fn mark_awaiting_adoption(&self, pod_uid: &str) -> Result<(), StoreError> {
        mark_awaiting(&self.conn(), pod_uid, crate::time::now_ms())?;
        self.notify();
        Ok(())
    }

    /// The pod object was not deleted after all: its sandbox is the pod's again.
    /// Pod uid -> since when (unix ms) the cache no longer holds the pod object of a sandbox
    /// awaiting adoption: the adopt timeout counts from then.
    pub fn deletions_seen(&self, now_ms: i64) -> Result<HashMap<String, i64>, StoreError> {
        deletions_seen(&self.conn(), now_ms)
    }

    /// Whether a DaemonSet is gone from a cache that has listed its namespace's DaemonSets.
    pub fn daemonset_gone(&self, namespace: &str, owner_uid: &str) -> Result<bool, StoreError> {
        daemonset_gone(&self.conn(), namespace, owner_uid)
    }

    pub fn unmark_awaiting_adoption(&self, pod_uid: &str) -> Result<(), StoreError> {
        unmark_awaiting(&self.conn(), pod_uid)?;
        self.notify();
        Ok(())
    }

    /// Binds `pod_uid` to the CRI objects labelled `label_uid` (delete-and-adopt).
    pub fn adopt(&self, label_uid: &str, pod_uid: &str) -> Result<(), StoreError> {
        adopt(&mut self.conn(), label_uid, pod_uid, crate::time::now_ms())?;
        self.notify();
        Ok(())
    }

    /// Label uid -> the pod its CRI objects belong to, for adopted sandboxes.
    pub fn pod_aliases(&self) -> Result<HashMap<String, String>, StoreError> {
        Ok(aliases(&self.conn())?.into_iter().collect())
    }

    pub fn forget_aliases_of(&self, pod_uid: &str) -> Result<(), StoreError> {
        forget_aliases_of(&self.conn(), pod_uid)
    }

    pub fn forget_running_revision(&self, pod_uid: &str) -> Result<(), StoreError> {
        forget_running_revision(&self.conn(), pod_uid)?;
        self.notify();
        Ok(())
    }
}
