//! Transactions: upgrade requests grouped under one decision of the OTA manager (commit or
//! roll back) and one commit deadline. The engine owns what the states mean; the store keeps
//! the facts and the two rules that must hold in one write: a transaction is committed only
//! while every member is Verified, and a member of a committed transaction never rolls back
//! (see [`super::journal::transition`]).

use super::requests::{self, row, NewRequest, RequestRecord, COLUMNS};
use super::StoreError;
use rusqlite::{params, Connection, OptionalExtension};

/// Ended transactions kept for `GET /v1/transactions`; older ones go when a new one starts.
pub const TRANSACTIONS_KEPT: i64 = 50;

/// The manager's decision, or the engine's on its behalf (a deadline, a member that failed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Commit,
    Rollback,
}

impl Decision {
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Commit => "commit",
            Decision::Rollback => "rollback",
        }
    }

    fn parse(s: &str) -> Option<Decision> {
        match s {
            "commit" => Some(Decision::Commit),
            "rollback" => Some(Decision::Rollback),
            _ => None,
        }
    }
}

/// A transaction as stored, with its members' requests in install order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnRecord {
    pub id: String,
    pub decision: Option<Decision>,
    /// Why it rolls back (the manager's reason, the deadline, the member that failed).
    pub reason: Option<String>,
    pub commit_timeout_ms: i64,
    /// Time spent Verified, counted up to `clock_ms` (see [`crate::store`]'s migration 13).
    pub elapsed_ms: i64,
    /// The boot whose clock `clock_ms` is on.
    pub clock_boot: Option<String>,
    /// Where on that boot clock `elapsed_ms` was last brought up to; `None`: not counting.
    pub clock_ms: Option<i64>,
    pub created_ms: i64,
    pub updated_ms: i64,
    pub members: Vec<RequestRecord>,
}

/// The outcome of starting a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnCreated {
    New(TxnRecord),
    /// A pod of it already has an active upgrade; nothing was written.
    Active(RequestRecord),
}

/// The outcome of a decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decided {
    /// Recorded now.
    Now(TxnRecord),
    /// The transaction had this decision already (nothing written).
    Already(TxnRecord),
    /// Refused: another decision stands, or (commit) a member is not Verified.
    Refused(TxnRecord),
    Unknown,
}

const TXN_COLUMNS: &str = "id, decision, reason, commit_timeout_ms, elapsed_ms, clock_boot, \
                           clock_ms, created_ms, updated_ms";

fn txn_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<TxnRecord> {
    let decision: Option<String> = r.get(1)?;
    Ok(TxnRecord {
        id: r.get(0)?,
        // Only this module writes the column, with Decision::as_str.
        decision: decision.as_deref().and_then(Decision::parse),
        reason: r.get(2)?,
        commit_timeout_ms: r.get(3)?,
        elapsed_ms: r.get(4)?,
        clock_boot: r.get(5)?,
        clock_ms: r.get(6)?,
        created_ms: r.get(7)?,
        updated_ms: r.get(8)?,
        members: Vec::new(),
    })
}

fn members(conn: &Connection, id: &str) -> rusqlite::Result<Vec<RequestRecord>> {
    let cols = COLUMNS
        .split(", ")
        .map(|c| format!("r.{c}"))
        .collect::<Vec<_>>()
        .join(", ");
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {cols} FROM transaction_members m JOIN requests r ON r.id = m.request_id
         WHERE m.txn = ?1 ORDER BY m.position"
    ))?;
    let rows = stmt.query_map(params![id], row)?;
    rows.collect()
}

fn with_members(conn: &Connection, mut t: TxnRecord) -> rusqlite::Result<TxnRecord> {
    t.members = members(conn, &t.id)?;
    Ok(t)
}

pub fn get(conn: &Connection, id: &str) -> Result<Option<TxnRecord>, StoreError> {
    let t = conn
        .prepare_cached(&format!(
            "SELECT {TXN_COLUMNS} FROM transactions WHERE id = ?1"
        ))?
        .query_row(params![id], txn_row)
        .optional()?;
    Ok(match t {
        Some(t) => Some(with_members(conn, t)?),
        None => None,
    })
}

/// The newest `limit` transactions, newest first.
pub fn list(conn: &Connection, limit: i64) -> Result<Vec<TxnRecord>, StoreError> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {TXN_COLUMNS} FROM transactions ORDER BY seq DESC LIMIT ?1"
    ))?;
    let rows: Vec<TxnRecord> = stmt
        .query_map(params![limit], txn_row)?
        .collect::<Result<_, _>>()?;
    Ok(rows
        .into_iter()
        .map(|t| with_members(conn, t))
        .collect::<Result<_, _>>()?)
}

/// Transactions with a member still active, or no decision yet: the engine's to watch.
pub fn open(conn: &Connection) -> Result<Vec<TxnRecord>, StoreError> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {TXN_COLUMNS} FROM transactions t WHERE decision IS NULL OR EXISTS (
             SELECT 1 FROM transaction_members m JOIN requests r ON r.id = m.request_id
             WHERE m.txn = t.id AND r.state NOT IN ('Done', 'RolledBack', 'Failed'))
         ORDER BY seq"
    ))?;
    let rows: Vec<TxnRecord> = stmt.query_map([], txn_row)?.collect::<Result<_, _>>()?;
    Ok(rows
        .into_iter()
        .map(|t| with_members(conn, t))
        .collect::<Result<_, _>>()?)
}

/// The transaction request `request_id` belongs to, if any.
pub fn of_request(conn: &Connection, request_id: i64) -> Result<Option<TxnRecord>, StoreError> {
    let id: Option<String> = conn
        .prepare_cached("SELECT txn FROM transaction_members WHERE request_id = ?1")?
        .query_row(params![request_id], |r| r.get(0))
        .optional()?;
    match id {
        Some(id) => get(conn, &id),
        None => Ok(None),
    }
}

/// Records a transaction of `reqs` (upgrade requests, in install order) in one write: every
/// request or none. A pod with an active upgrade refuses the whole transaction.
pub fn create(
    conn: &mut Connection,
    id: &str,
    commit_timeout_ms: i64,
    reqs: &[NewRequest<'_>],
) -> Result<TxnCreated, StoreError> {
    let tx = conn.transaction()?;
    for r in reqs {
        if let Some(active) = requests::active(&tx, r.kind, r.pod_uid)? {
            return Ok(TxnCreated::Active(active));
        }
    }
    let now = crate::time::now_ms();
    tx.prepare_cached(
        "INSERT INTO transactions (id, commit_timeout_ms, created_ms, updated_ms)
         VALUES (?1, ?2, ?3, ?3)",
    )?
    .execute(params![id, commit_timeout_ms, now])?;
    for (i, r) in reqs.iter().enumerate() {
        let request_id = requests::insert(&tx, r, now)?;
        tx.prepare_cached(
            "INSERT INTO transaction_members (txn, position, request_id) VALUES (?1, ?2, ?3)",
        )?
        .execute(params![id, i as i64, request_id])?;
    }
    prune(&tx)?;
    let rec = get(&tx, id)?.ok_or_else(|| {
        StoreError::Sqlite(rusqlite::Error::QueryReturnedNoRows) // just inserted
    })?;
    tx.commit()?;
    Ok(TxnCreated::New(rec))
}

/// Keeps the newest [`TRANSACTIONS_KEPT`] ended transactions (decided, no member active) and
/// every open one. Their requests stay: the journal prunes those per pod.
fn prune(conn: &Connection) -> Result<(), StoreError> {
    let old: Vec<String> = conn
        .prepare_cached(
            "SELECT id FROM transactions t WHERE decision IS NOT NULL AND NOT EXISTS (
                 SELECT 1 FROM transaction_members m JOIN requests r ON r.id = m.request_id
                 WHERE m.txn = t.id AND r.state NOT IN ('Done', 'RolledBack', 'Failed'))
             ORDER BY seq DESC LIMIT -1 OFFSET ?1",
        )?
        .query_map(params![TRANSACTIONS_KEPT], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    for id in old {
        conn.prepare_cached("DELETE FROM transaction_members WHERE txn = ?1")?
            .execute(params![id])?;
        conn.prepare_cached("DELETE FROM transactions WHERE id = ?1")?
            .execute(params![id])?;
    }
    Ok(())
}

/// Records `decision` if none stands. A commit also needs every member Verified, checked in
/// the same write, so a member that left Verified first (its new container exited) wins.
pub fn decide(
    conn: &mut Connection,
    id: &str,
    decision: Decision,
    reason: Option<&str>,
) -> Result<Decided, StoreError> {
    let tx = conn.transaction()?;
    let Some(t) = get(&tx, id)? else {
        return Ok(Decided::Unknown);
    };
    if let Some(d) = t.decision {
        return Ok(if d == decision {
            Decided::Already(t)
        } else {
            Decided::Refused(t)
        });
    }
    if decision == Decision::Commit && t.members.iter().any(|m| m.state != "Verified") {
        return Ok(Decided::Refused(t));
    }
    tx.prepare_cached(
        "UPDATE transactions SET decision = ?2, reason = ?3, updated_ms = ?4
         WHERE id = ?1 AND decision IS NULL",
    )?
    .execute(params![
        id,
        decision.as_str(),
        reason,
        crate::time::now_ms()
    ])?;
    let t = get(&tx, id)?.ok_or_else(|| {
        StoreError::Sqlite(rusqlite::Error::QueryReturnedNoRows) // read in this transaction
    })?;
    tx.commit()?;
    Ok(Decided::Now(t))
}

/// Brings the deadline's count to `elapsed_ms`, counted from `clock_ms` on the boot clock of
/// `clock_boot` (`None`: not counting), while no decision stands.
pub fn set_clock(
    conn: &Connection,
    id: &str,
    elapsed_ms: i64,
    clock_boot: Option<&str>,
    clock_ms: Option<i64>,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "UPDATE transactions SET elapsed_ms = ?2, clock_boot = ?3, clock_ms = ?4
         WHERE id = ?1 AND decision IS NULL",
    )?
    .execute(params![id, elapsed_ms, clock_boot, clock_ms])?;
    Ok(())
}

impl super::Store {
    /// Records a transaction of upgrade requests: all of them, or none when a pod already has
    /// an active upgrade. Wakes the engine.
    pub fn create_transaction(
        &self,
        id: &str,
        commit_timeout_ms: i64,
        reqs: &[NewRequest<'_>],
    ) -> Result<TxnCreated, StoreError> {
        let r = create(&mut self.conn(), id, commit_timeout_ms, reqs)?;
        if matches!(r, TxnCreated::New(_)) {
            self.notify();
        }
        Ok(r)
    }

    pub fn transaction(&self, id: &str) -> Result<Option<TxnRecord>, StoreError> {
        get(&self.conn(), id)
    }

    /// The newest transactions, newest first.
    pub fn transactions(&self, limit: i64) -> Result<Vec<TxnRecord>, StoreError> {
        list(&self.conn(), limit)
    }

    pub fn open_transactions(&self) -> Result<Vec<TxnRecord>, StoreError> {
        open(&self.conn())
    }

    pub fn transaction_of(&self, request_id: i64) -> Result<Option<TxnRecord>, StoreError> {
        of_request(&self.conn(), request_id)
    }

    /// Records a decision if none stands (see [`decide`]); wakes the engine when it did.
    pub fn decide_transaction(
        &self,
        id: &str,
        decision: Decision,
        reason: Option<&str>,
    ) -> Result<Decided, StoreError> {
        let r = decide(&mut self.conn(), id, decision, reason)?;
        if matches!(r, Decided::Now(_)) {
            self.notify();
        }
        Ok(r)
    }

    pub fn set_transaction_clock(
        &self,
        id: &str,
        elapsed_ms: i64,
        clock_boot: Option<&str>,
        clock_ms: Option<i64>,
    ) -> Result<(), StoreError> {
        set_clock(&self.conn(), id, elapsed_ms, clock_boot, clock_ms)
    }
}
