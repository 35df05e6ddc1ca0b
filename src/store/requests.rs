//! Upgrade and image-pull requests: what the local API accepted, for the upgrade engine to
//! carry out. The engine owns the state machine; the store only knows which states are
//! terminal, so that "one active request per pod" is enforced by a unique index.

use super::StoreError;
use rusqlite::{params, Connection, OptionalExtension, Row};

/// States after which a new request for the same pod is allowed.
pub const TERMINAL_STATES: [&str; 3] = ["Done", "RolledBack", "Failed"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    Upgrade,
    ImagePull,
}

impl RequestKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RequestKind::Upgrade => "upgrade",
            RequestKind::ImagePull => "imagepull",
        }
    }

    fn parse(s: &str) -> Option<RequestKind> {
        match s {
            "upgrade" => Some(RequestKind::Upgrade),
            "imagepull" => Some(RequestKind::ImagePull),
            _ => None,
        }
    }
}

/// A request as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    pub id: i64,
    /// Unique across databases: the label of the CRI objects this request creates.
    pub uid: String,
    pub kind: RequestKind,
    pub pod_uid: String,
    pub namespace: String,
    pub name: String,
    pub from_hash: Option<String>,
    pub to_hash: String,
    pub state: String,
    pub error: Option<String>,
    pub created_ms: i64,
    pub updated_ms: i64,
    /// When the current state must be over, on the boot clock of `clock_boot`.
    pub deadline_ms: Option<i64>,
    /// Since when the new containers have been ready (Verifying), on the same clock.
    pub ready_since_ms: Option<i64>,
    /// The plan fixed when the upgrade started (JSON), so a restart follows the same one.
    pub plan: Option<String>,
    /// The boot the two points above were taken in ([`crate::time::boot_id`]).
    pub clock_boot: Option<String>,
    /// Why the request cannot go on now (the runtime does not answer, an input is missing).
    pub waiting: Option<String>,
}

impl RequestRecord {
    pub fn is_terminal(&self) -> bool {
        TERMINAL_STATES.contains(&self.state.as_str())
    }

    /// The deadline on this boot's clock; `None` also when it was set in another boot.
    pub fn deadline(&self) -> Option<i64> {
        crate::time::boot_point(self.clock_boot.as_deref(), self.deadline_ms)
    }

    /// Since when the new containers have been ready, on this boot's clock.
    pub fn ready_since(&self) -> Option<i64> {
        crate::time::boot_point(self.clock_boot.as_deref(), self.ready_since_ms)
    }

    /// The state has a deadline, set in another boot (or before the boot clock was used):
    /// how much of it is left is unknown.
    pub fn deadline_from_another_boot(&self) -> bool {
        self.deadline_ms.is_some() && self.deadline().is_none()
    }
}

/// Terminal requests kept per pod and kind, newest first; older ones (and their logs) go when
/// another one ends, so repeated requests cannot grow the database without bound.
pub const HISTORY_PER_POD: i64 = 5;

/// A new id for a request: 128 random bits as hex, unique across databases.
pub fn new_uid() -> String {
    let mut b = [0u8; 16];
    // SAFETY: getrandom(2) writes at most b.len() bytes into a buffer we own.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        // Never seen on Linux >= 3.17; fall back to a seeded generator plus the clocks, which
        // still does not repeat across databases on one device.
        let seed = (crate::time::now_ms() as u64) ^ (crate::time::boot_ms() as u64).rotate_left(32);
        let mut r = fastrand::Rng::with_seed(seed ^ fastrand::u64(..));
        r.fill(&mut b);
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A request to record.
#[derive(Debug, Clone)]
pub struct NewRequest<'a> {
    pub kind: RequestKind,
    pub pod_uid: &'a str,
    pub namespace: &'a str,
    pub name: &'a str,
    pub from_hash: Option<&'a str>,
    pub to_hash: &'a str,
}

/// The outcome of recording a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    /// Stored in state `Requested`.
    New(RequestRecord),
    /// A request of the same kind for the same pod is still active; nothing was written.
    Active(RequestRecord),
}

pub(super) const COLUMNS: &str =
    "id, kind, pod_uid, namespace, name, from_hash, to_hash, state, error, created_ms, updated_ms, deadline_ms, ready_since_ms, plan, uid, clock_boot, waiting";

pub(super) fn row(r: &Row<'_>) -> rusqlite::Result<RequestRecord> {
    let kind: String = r.get(1)?;
    Ok(RequestRecord {
        id: r.get(0)?,
        // Only this module writes the column, with RequestKind::as_str.
        kind: RequestKind::parse(&kind).unwrap_or(RequestKind::Upgrade),
        pod_uid: r.get(2)?,
        namespace: r.get(3)?,
        name: r.get(4)?,
        from_hash: r.get(5)?,
        to_hash: r.get(6)?,
        state: r.get(7)?,
        error: r.get(8)?,
        created_ms: r.get(9)?,
        updated_ms: r.get(10)?,
        deadline_ms: r.get(11)?,
        ready_since_ms: r.get(12)?,
        plan: r.get(13)?,
        uid: r.get(14)?,
        clock_boot: r.get(15)?,
        waiting: r.get(16)?,
    })
}

pub(super) fn active(
    conn: &Connection,
    kind: RequestKind,
    pod_uid: &str,
) -> rusqlite::Result<Option<RequestRecord>> {
    let sql = format!(
        "SELECT {COLUMNS} FROM requests WHERE pod_uid = ?1 AND kind = ?2
         AND state NOT IN ('Done', 'RolledBack', 'Failed') ORDER BY id DESC LIMIT 1"
    );
    conn.prepare_cached(&sql)?
        .query_row(params![pod_uid, kind.as_str()], row)
        .optional()
}

pub fn record(conn: &mut Connection, req: &NewRequest<'_>) -> Result<Recorded, StoreError> {
    let tx = conn.transaction()?;
    if let Some(existing) = active(&tx, req.kind, req.pod_uid)? {
        return Ok(Recorded::Active(existing));
    }
    let now = crate::time::now_ms();
    // A pre-pull asked again for the same target reuses its row: the OTA manager may ask on
    // every poll, and each ask must not leave a row behind.
    let reuse: Option<i64> = if req.kind == RequestKind::ImagePull {
        tx.prepare_cached(
            "SELECT id FROM requests WHERE pod_uid = ?1 AND kind = 'imagepull' AND to_hash = ?2
             ORDER BY id DESC LIMIT 1",
        )?
        .query_row(params![req.pod_uid, req.to_hash], |r| r.get(0))
        .optional()?
    } else {
        None
    };
    let id = match reuse {
        Some(id) => {
            tx.prepare_cached(
                "UPDATE requests SET state = 'Requested', error = NULL, from_hash = ?2,
                     namespace = ?3, name = ?4, deadline_ms = NULL, ready_since_ms = NULL,
                     waiting = NULL, clock_boot = NULL, updated_ms = ?5
                 WHERE id = ?1",
            )?
            .execute(params![id, req.from_hash, req.namespace, req.name, now])?;
            tx.prepare_cached("DELETE FROM request_log WHERE request_id = ?1")?
                .execute(params![id])?;
            id
        }
        None => insert(&tx, req, now)?,
    };
    let rec = tx
        .prepare_cached(&format!("SELECT {COLUMNS} FROM requests WHERE id = ?1"))?
        .query_row(params![id], row)?;
    tx.commit()?;
    Ok(Recorded::New(rec))
}

/// Inserts a new request in state `Requested` with a new uid; returns its row id.
pub(super) fn insert(conn: &Connection, req: &NewRequest<'_>, now: i64) -> rusqlite::Result<i64> {
    conn.prepare_cached(
        "INSERT INTO requests (kind, pod_uid, namespace, name, from_hash, to_hash, state,
             created_ms, updated_ms, uid)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'Requested', ?7, ?7, ?8)",
    )?
    .execute(params![
        req.kind.as_str(),
        req.pod_uid,
        req.namespace,
        req.name,
        req.from_hash,
        req.to_hash,
        now,
        new_uid()
    ])?;
    Ok(conn.last_insert_rowid())
}

/// Keeps the newest [`HISTORY_PER_POD`] terminal requests of this pod and kind, and the
/// active one; removes the rest with their logs. Runs in the transaction that ends one.
pub(super) fn prune(conn: &Connection, pod_uid: &str, kind: &str) -> Result<usize, StoreError> {
    let old = "SELECT id FROM requests WHERE pod_uid = ?1 AND kind = ?2
               AND state IN ('Done', 'RolledBack', 'Failed')
               ORDER BY id DESC LIMIT -1 OFFSET ?3";
    conn.prepare_cached(&format!(
        "DELETE FROM request_log WHERE request_id IN ({old})"
    ))?
    .execute(params![pod_uid, kind, HISTORY_PER_POD])?;
    let n = conn
        .prepare_cached(&format!("DELETE FROM requests WHERE id IN ({old})"))?
        .execute(params![pod_uid, kind, HISTORY_PER_POD])?;
    Ok(n)
}

/// Which of `uids` name requests that ended without committing (RolledBack, Failed).
pub fn ended_without_commit(
    conn: &Connection,
    uids: &[&str],
) -> Result<std::collections::HashSet<String>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT 1 FROM requests WHERE uid = ?1 AND state IN ('RolledBack', 'Failed')",
    )?;
    let mut out = std::collections::HashSet::new();
    for u in uids {
        if stmt.exists(params![u])? {
            out.insert(u.to_string());
        }
    }
    Ok(out)
}

/// Sets the deadline of request `id` in `state` on this boot's clock (clearing the readiness
/// mark, which was on the same clock); returns whether the row was still in `state`.
pub fn set_deadline(
    conn: &Connection,
    id: i64,
    state: &str,
    deadline_ms: Option<i64>,
) -> Result<bool, StoreError> {
    let n = conn
        .prepare_cached(
            "UPDATE requests SET deadline_ms = ?3, ready_since_ms = NULL, clock_boot = ?4
             WHERE id = ?1 AND state = ?2",
        )?
        .execute(params![id, state, deadline_ms, crate::time::boot_id()])?;
    Ok(n > 0)
}

/// Records why request `id` cannot go on now (`None`: it can); writes only on a change.
pub fn set_waiting(conn: &Connection, id: i64, waiting: Option<&str>) -> Result<(), StoreError> {
    conn.prepare_cached("UPDATE requests SET waiting = ?2 WHERE id = ?1 AND waiting IS NOT ?2")?
        .execute(params![id, waiting])?;
    Ok(())
}

pub fn latest(
    conn: &Connection,
    kind: RequestKind,
    namespace: &str,
    name: &str,
) -> Result<Option<RequestRecord>, StoreError> {
    let sql = format!(
        "SELECT {COLUMNS} FROM requests WHERE namespace = ?1 AND name = ?2 AND kind = ?3
         ORDER BY id DESC LIMIT 1"
    );
    Ok(conn
        .prepare_cached(&sql)?
        .query_row(params![namespace, name, kind.as_str()], row)
        .optional()?)
}

pub fn active_all(conn: &Connection) -> Result<Vec<RequestRecord>, StoreError> {
    let sql = format!(
        "SELECT {COLUMNS} FROM requests WHERE state NOT IN ('Done', 'RolledBack', 'Failed') ORDER BY id"
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt.query_map([], row)?;
    Ok(rows.collect::<Result<_, _>>()?)
}

pub fn set_state(
    conn: &Connection,
    id: i64,
    state: &str,
    error: Option<&str>,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "UPDATE requests SET state = ?2, error = ?3, updated_ms = ?4 WHERE id = ?1",
    )?
    .execute(params![id, state, error, crate::time::now_ms()])?;
    Ok(())
}

impl super::Store {
    /// The id of the newest request of `kind` that ended `Done`; image garbage collection
    /// runs after each new one.
    pub fn last_done_request(&self, kind: RequestKind) -> Result<Option<i64>, StoreError> {
        Ok(self.conn().query_row(
            "SELECT max(id) FROM requests WHERE kind = ?1 AND state = 'Done'",
            rusqlite::params![kind.as_str()],
            |r| r.get(0),
        )?)
    }

    /// Records an upgrade or image-pull request in state `Requested`, unless one of the same
    /// kind is still active for that pod (then nothing is written).
    /// Records a request; a new one wakes the readers (the upgrade engine starts it at once).
    pub fn record_request(&self, req: &NewRequest<'_>) -> Result<Recorded, StoreError> {
        let r = record(&mut self.conn(), req)?;
        if matches!(r, Recorded::New(_)) {
            self.notify();
        }
        Ok(r)
    }

    /// The newest request of `kind` for the pod `namespace/name`.
    pub fn latest_request(
        &self,
        kind: RequestKind,
        namespace: &str,
        name: &str,
    ) -> Result<Option<RequestRecord>, StoreError> {
        latest(&self.conn(), kind, namespace, name)
    }

    /// Which of these request uids ended without committing (RolledBack, Failed).
    pub fn ended_without_commit(
        &self,
        uids: &[&str],
    ) -> Result<std::collections::HashSet<String>, StoreError> {
        ended_without_commit(&self.conn(), uids)
    }

    /// The pod's active request of `kind`, if one is.
    pub fn active_request(
        &self,
        kind: RequestKind,
        pod_uid: &str,
    ) -> Result<Option<RequestRecord>, StoreError> {
        Ok(active(&self.conn(), kind, pod_uid)?)
    }

    /// Every request not yet in a terminal state, oldest first.
    pub fn active_requests(&self) -> Result<Vec<RequestRecord>, StoreError> {
        active_all(&self.conn())
    }

    /// Moves a request to `state` (the upgrade engine's transitions).
    pub fn set_request_state(
        &self,
        id: i64,
        state: &str,
        error: Option<&str>,
    ) -> Result<(), StoreError> {
        set_state(&self.conn(), id, state, error)
    }

    /// Sets the deadline of request `id` in `state`, on this boot's clock.
    pub fn set_request_deadline(
        &self,
        id: i64,
        state: &str,
        deadline_ms: Option<i64>,
    ) -> Result<bool, StoreError> {
        set_deadline(&self.conn(), id, state, deadline_ms)
    }

    /// Records why request `id` cannot go on now; writes only when that changes.
    pub fn set_request_waiting(&self, id: i64, waiting: Option<&str>) -> Result<(), StoreError> {
        set_waiting(&self.conn(), id, waiting)
    }
}
