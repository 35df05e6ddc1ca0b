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
    /// When the current state must be over.
    pub deadline_ms: Option<i64>,
    /// Since when the new containers have been ready (Verifying).
    pub ready_since_ms: Option<i64>,
    /// The plan fixed when the upgrade started (JSON), so a restart follows the same one.
    pub plan: Option<String>,
}

impl RequestRecord {
    pub fn is_terminal(&self) -> bool {
        TERMINAL_STATES.contains(&self.state.as_str())
    }
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
    "id, kind, pod_uid, namespace, name, from_hash, to_hash, state, error, created_ms, updated_ms, deadline_ms, ready_since_ms, plan";

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
    })
}

fn active(
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
    tx.prepare_cached(
        "INSERT INTO requests (kind, pod_uid, namespace, name, from_hash, to_hash, state, created_ms, updated_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'Requested', ?7, ?7)",
    )?
    .execute(params![
        req.kind.as_str(),
        req.pod_uid,
        req.namespace,
        req.name,
        req.from_hash,
        req.to_hash,
        now
    ])?;
    let id = tx.last_insert_rowid();
    let rec = tx
        .prepare_cached(&format!("SELECT {COLUMNS} FROM requests WHERE id = ?1"))?
        .query_row(params![id], row)?;
    tx.commit()?;
    Ok(Recorded::New(rec))
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
