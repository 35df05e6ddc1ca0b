//! The outbox: everything edgehub owes the apiserver, in one durable, ordered queue. Producers
//! (the runtime, the upgrade engine) only enqueue, in the same transaction as the state they
//! report where they have one; one sender drains it while the link is up.
//!
//! A row has a kind (a pod's wanted status, or an Event), the pod it is about, a dedupe key,
//! its body, how often it was tried, when it may be tried next, and the last error. Rows are
//! sent in order per pod. Queuing a status again replaces the pod's queued one (the latest
//! wins, and goes behind what was queued before it); queuing an Event again counts one more
//! occurrence (the row keeps the place of its first undelivered one), and the Event's series
//! (`event_series`: its total count, its first timestamp, whether the apiserver holds it) is
//! kept beside the queue, since a node may not read Events back. A
//! row the apiserver refuses is parked: kept with its error, shown, no longer in the way of
//! the rows behind it, and tried again now and then.

use super::StoreError;
use rusqlite::{params, Connection, OptionalExtension, Row};

/// What a row carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowKind {
    /// The status edgehub wants a pod to have (the patch is computed when it is sent).
    Status,
    Event,
}

impl RowKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RowKind::Status => "status",
            RowKind::Event => "event",
        }
    }

    fn parse(s: &str) -> RowKind {
        if s == "event" {
            RowKind::Event
        } else {
            RowKind::Status
        }
    }
}

/// One row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRow {
    pub id: i64,
    pub kind: RowKind,
    pub pod_uid: String,
    pub namespace: String,
    pub name: String,
    pub dedupe: String,
    pub body: String,
    /// For Events: how many times it happened since it was last delivered.
    pub occurrences: i64,
    pub attempts: i64,
    pub next_attempt_ms: i64,
    pub last_error: Option<String>,
    pub parked: bool,
}

/// The status edgehub wants a pod to have: its own fields (phase, its conditions, container
/// statuses, IPs), merged onto the status the apiserver held when it was queued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedStatus {
    pub pod_uid: String,
    pub namespace: String,
    pub name: String,
    /// The `status` object, JSON.
    pub status: String,
}

/// An Event waiting for the link. `key` is the Event's namespace/name: queuing the same key
/// again bumps `occurrences` and replaces the body, the kubelet's event series.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedEvent {
    /// The pod it is about (the outbox keeps each pod's rows in order).
    pub pod_uid: String,
    pub key: String,
    pub namespace: String,
    pub body: String,
    /// How many times it happened since it was last delivered.
    pub occurrences: i64,
}

const COLUMNS: &str = "id, kind, pod_uid, namespace, name, dedupe, body, occurrences, attempts, next_attempt_ms, last_error, parked";

fn row(r: &Row<'_>) -> rusqlite::Result<OutboxRow> {
    let kind: String = r.get(1)?;
    Ok(OutboxRow {
        id: r.get(0)?,
        kind: RowKind::parse(&kind),
        pod_uid: r.get(2)?,
        namespace: r.get(3)?,
        name: r.get(4)?,
        dedupe: r.get(5)?,
        body: r.get(6)?,
        occurrences: r.get(7)?,
        attempts: r.get(8)?,
        next_attempt_ms: r.get(9)?,
        last_error: r.get(10)?,
        parked: r.get(11)?,
    })
}

fn status_key(pod_uid: &str) -> String {
    format!("status/{pod_uid}")
}

fn event_key(key: &str) -> String {
    format!("event/{key}")
}

/// Queues a pod's wanted status, replacing the one queued before; returns whether anything
/// was written. The new one goes to the back of the queue: it is what the pod is now, after
/// the Events queued since the old one, and must not overtake them. A new status for a
/// parked row gives it another chance (it starts afresh).
pub fn queue_status(
    conn: &mut Connection,
    q: &QueuedStatus,
    now_ms: i64,
) -> Result<bool, StoreError> {
    let key = status_key(&q.pod_uid);
    let same: bool = conn
        .prepare_cached("SELECT EXISTS (SELECT 1 FROM outbox WHERE dedupe = ?1 AND body = ?2)")?
        .query_row(params![key, q.status], |r| r.get(0))?;
    if same {
        return Ok(false);
    }
    let tx = conn.transaction()?;
    tx.prepare_cached("DELETE FROM outbox WHERE dedupe = ?1")?
        .execute(params![key])?;
    tx.prepare_cached(
        "INSERT INTO outbox (kind, pod_uid, namespace, name, dedupe, body, queued_ms)
         VALUES ('status', ?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute(params![
        q.pod_uid,
        q.namespace,
        q.name,
        key,
        q.status,
        now_ms
    ])?;
    tx.commit()?;
    Ok(true)
}

/// The queued statuses that are not parked, oldest first.
pub fn queued_statuses(conn: &Connection) -> Result<Vec<QueuedStatus>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT pod_uid, namespace, name, body FROM outbox WHERE kind = 'status' AND parked = 0 ORDER BY id",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok(QueuedStatus {
            pod_uid: r.get(0)?,
            namespace: r.get(1)?,
            name: r.get(2)?,
            status: r.get(3)?,
        })
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// Removes a pod's queued status if it is still `status` (a newer one queued meanwhile stays);
/// `None` removes whatever is queued.
pub fn unqueue_status(
    conn: &Connection,
    pod_uid: &str,
    status: Option<&str>,
) -> Result<(), StoreError> {
    let key = status_key(pod_uid);
    match status {
        Some(s) => conn
            .prepare_cached("DELETE FROM outbox WHERE dedupe = ?1 AND body = ?2")?
            .execute(params![key, s])?,
        None => conn
            .prepare_cached("DELETE FROM outbox WHERE dedupe = ?1")?
            .execute(params![key])?,
    };
    Ok(())
}

/// Queues an Event; the same key again counts one more occurrence, in the outbox row (what
/// is still to deliver) and in the Event's series (its total, which is what the apiserver's
/// `count` is set to). One transaction is the caller's: both or neither.
pub fn queue_event(conn: &Connection, e: &QueuedEvent, now_ms: i64) -> Result<(), StoreError> {
    let name = e.key.rsplit('/').next().unwrap_or_default();
    let occurrences = e.occurrences.max(1);
    conn.prepare_cached(
        "INSERT INTO outbox (kind, pod_uid, namespace, name, dedupe, body, occurrences, queued_ms)
         VALUES ('event', ?1, ?2, ?3, ?4, ?5, ?6, ?7)
         ON CONFLICT (dedupe) DO UPDATE SET body = excluded.body,
             occurrences = occurrences + excluded.occurrences, parked = 0, next_attempt_ms = 0",
    )?
    .execute(params![
        e.pod_uid,
        e.namespace,
        name,
        event_key(&e.key),
        e.body,
        occurrences,
        now_ms
    ])?;
    conn.prepare_cached(
        "INSERT INTO event_series (key, pod_uid, count, first_timestamp)
         VALUES (?1, ?2, ?3, json_extract(?4, '$.firstTimestamp'))
         ON CONFLICT (key) DO UPDATE SET count = count + excluded.count",
    )?
    .execute(params![e.key, e.pod_uid, occurrences, e.body])?;
    Ok(())
}

/// An Event series as the device keeps it: a node may not read Events, so this is the only
/// record of what the apiserver holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSeries {
    /// Every occurrence queued so far: the `count` the Event is given.
    pub count: i64,
    /// When the series began, for a create.
    pub first_timestamp: Option<String>,
    /// A create or patch of it succeeded: the next occurrence is a PATCH.
    pub created: bool,
}

/// The series of the Event an outbox row carries (`None` for a row that is not an Event).
pub fn event_series(conn: &Connection, row: &OutboxRow) -> Result<Option<EventSeries>, StoreError> {
    let Some(key) = row.dedupe.strip_prefix("event/") else {
        return Ok(None);
    };
    Ok(conn
        .prepare_cached("SELECT count, first_timestamp, created FROM event_series WHERE key = ?1")?
        .query_row(params![key], |r| {
            Ok(EventSeries {
                count: r.get(0)?,
                first_timestamp: r.get(1)?,
                created: r.get(2)?,
            })
        })
        .optional()?)
}

/// Forgets the series of pods no longer cached that have nothing left to send: their Events
/// will not happen again (a pod's uid is never reused).
pub fn prune_event_series(conn: &Connection) -> Result<usize, StoreError> {
    Ok(conn
        .prepare_cached(
            "DELETE FROM event_series WHERE
                 NOT EXISTS (SELECT 1 FROM objects WHERE kind = 'Pod' AND uid = event_series.pod_uid)
                 AND NOT EXISTS (SELECT 1 FROM outbox WHERE dedupe = 'event/' || event_series.key)",
        )?
        .execute([])?)
}

/// The queued Events that are not parked, oldest first.
pub fn queued_events(conn: &Connection) -> Result<Vec<QueuedEvent>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT dedupe, namespace, body, occurrences, pod_uid FROM outbox WHERE kind = 'event' AND parked = 0 ORDER BY id",
    )?;
    let rows = stmt.query_map([], |r| {
        let dedupe: String = r.get(0)?;
        Ok(QueuedEvent {
            key: dedupe.strip_prefix("event/").unwrap_or(&dedupe).to_string(),
            namespace: r.get(1)?,
            body: r.get(2)?,
            occurrences: r.get(3)?,
            pod_uid: r.get(4)?,
        })
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// Every row, in the order they are sent (oldest first; per pod, in the order they were
/// queued). Parked rows are among them: the sender tries them again when they are due.
pub fn rows(conn: &Connection) -> Result<Vec<OutboxRow>, StoreError> {
    let mut stmt = conn.prepare_cached(&format!("SELECT {COLUMNS} FROM outbox ORDER BY id"))?;
    let rows = stmt.query_map([], row)?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// The earliest retry time after `now_ms` among rows waiting for one (parked ones too).
pub fn next_attempt_after(conn: &Connection, now_ms: i64) -> Result<Option<i64>, StoreError> {
    Ok(conn
        .prepare_cached("SELECT MIN(next_attempt_ms) FROM outbox WHERE next_attempt_ms > ?1")?
        .query_row(params![now_ms], |r| r.get::<_, Option<i64>>(0))?)
}

/// The parked rows.
pub fn parked(conn: &Connection) -> Result<Vec<OutboxRow>, StoreError> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {COLUMNS} FROM outbox WHERE parked = 1 ORDER BY id"
    ))?;
    let rows = stmt.query_map([], row)?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// A row was delivered as `sent` was: removed, unless it changed meanwhile (a newer status,
/// more occurrences of the Event), which stays queued (only the occurrences delivered go). An
/// Event's series is marked as held by the apiserver. One transaction.
pub fn delivered(conn: &mut Connection, sent: &OutboxRow) -> Result<(), StoreError> {
    let tx = conn.transaction()?;
    match sent.kind {
        RowKind::Status => {
            tx.prepare_cached("DELETE FROM outbox WHERE id = ?1 AND body = ?2")?
                .execute(params![sent.id, sent.body])?;
        }
        RowKind::Event => {
            tx.prepare_cached("DELETE FROM outbox WHERE id = ?1 AND occurrences <= ?2")?
                .execute(params![sent.id, sent.occurrences])?;
            tx.prepare_cached(
                "UPDATE outbox SET occurrences = occurrences - ?2, attempts = 0, last_error = NULL
                 WHERE id = ?1 AND occurrences > ?2",
            )?
            .execute(params![sent.id, sent.occurrences])?;
            if let Some(key) = sent.dedupe.strip_prefix("event/") {
                tx.prepare_cached(
                    "UPDATE event_series SET created = 1 WHERE key = ?1 AND created = 0",
                )?
                .execute(params![key])?;
            }
        }
    }
    tx.commit()?;
    Ok(())
}

/// Drops a row the apiserver will never need (its target is gone).
pub fn drop_row(conn: &Connection, id: i64) -> Result<(), StoreError> {
    conn.prepare_cached("DELETE FROM outbox WHERE id = ?1")?
        .execute(params![id])?;
    Ok(())
}

/// A failed attempt: try again at `next_ms`.
pub fn retry(conn: &Connection, id: i64, next_ms: i64, error: &str) -> Result<(), StoreError> {
    conn.prepare_cached(
        "UPDATE outbox SET attempts = attempts + 1, next_attempt_ms = ?2, last_error = ?3 WHERE id = ?1",
    )?
    .execute(params![id, next_ms, error])?;
    Ok(())
}

/// A row the apiserver refused: kept with its error, out of the way of the rows behind it,
/// and tried again at `next_ms`.
pub fn park(conn: &Connection, id: i64, next_ms: i64, error: &str) -> Result<(), StoreError> {
    conn.prepare_cached(
        "UPDATE outbox SET attempts = attempts + 1, parked = 1, next_attempt_ms = ?2,
             last_error = ?3 WHERE id = ?1",
    )?
    .execute(params![id, next_ms, error])?;
    Ok(())
}

/// Rows queued and parked.
pub fn counts(conn: &Connection) -> Result<(u64, u64), StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT COALESCE(SUM(parked = 0), 0), COALESCE(SUM(parked = 1), 0) FROM outbox",
        )?
        .query_row([], |r| {
            Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64))
        })?)
}

impl super::Store {
    /// Queues a pod status patch (replacing an older one for the same pod). Returns whether
    /// anything was written: an unchanged status costs no write.
    /// Queues the status edgehub wants a pod to have; returns whether it was written.
    pub fn queue_status(&self, q: &QueuedStatus) -> Result<bool, StoreError> {
        let wrote = queue_status(&mut self.conn(), q, crate::time::now_ms())?;
        if wrote {
            self.report_queued();
        }
        Ok(wrote)
    }

    pub fn queued_statuses(&self) -> Result<Vec<QueuedStatus>, StoreError> {
        queued_statuses(&self.conn())
    }

    /// Takes a pod's status off the queue: `Some(status)` only if it is still that one.
    pub fn unqueue_status(&self, pod_uid: &str, status: Option<&str>) -> Result<(), StoreError> {
        unqueue_status(&self.conn(), pod_uid, status)
    }

    /// Queues a Warning Event; the same key again counts one more occurrence.
    pub fn queue_event(&self, e: &QueuedEvent, now_ms: i64) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        queue_event(&tx, e, now_ms)?;
        tx.commit()?;
        drop(conn);
        self.report_queued();
        Ok(())
    }

    /// The series of the Event `row` carries, as the device keeps it.
    pub fn event_series(&self, row: &OutboxRow) -> Result<Option<EventSeries>, StoreError> {
        event_series(&self.conn(), row)
    }

    /// Forgets the Event series of pods that are gone and owe nothing; returns how many.
    pub fn prune_event_series(&self) -> Result<usize, StoreError> {
        prune_event_series(&self.conn())
    }

    pub fn queued_events(&self) -> Result<Vec<QueuedEvent>, StoreError> {
        queued_events(&self.conn())
    }

    /// The rows to send, in order (parked ones too, tried again when due).
    pub fn outbox(&self) -> Result<Vec<OutboxRow>, StoreError> {
        rows(&self.conn())
    }

    /// The earliest retry time after `now_ms` among the rows waiting for one.
    pub fn outbox_next_attempt_after(&self, now_ms: i64) -> Result<Option<i64>, StoreError> {
        next_attempt_after(&self.conn(), now_ms)
    }

    /// The parked rows: refused for good, kept with their error.
    pub fn outbox_parked(&self) -> Result<Vec<OutboxRow>, StoreError> {
        parked(&self.conn())
    }

    /// Rows queued and parked.
    pub fn outbox_counts(&self) -> Result<(u64, u64), StoreError> {
        counts(&self.conn())
    }

    /// A row was delivered as `sent` was (what changed meanwhile stays queued).
    pub fn outbox_delivered(&self, sent: &OutboxRow) -> Result<(), StoreError> {
        delivered(&mut self.conn(), sent)?;
        self.took_from_outbox();
        Ok(())
    }

    pub fn outbox_drop(&self, id: i64) -> Result<(), StoreError> {
        drop_row(&self.conn(), id)?;
        self.took_from_outbox();
        Ok(())
    }

    fn took_from_outbox(&self) {
        self.outbox_taken
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// Counts the rows the sender took off the queue: when it changed, a copy of the queue
    /// read before may hold statuses that are no longer queued.
    pub fn outbox_taken(&self) -> u64 {
        self.outbox_taken.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn outbox_retry(&self, id: i64, next_ms: i64, error: &str) -> Result<(), StoreError> {
        retry(&self.conn(), id, next_ms, error)
    }

    pub fn outbox_park(&self, id: i64, next_ms: i64, error: &str) -> Result<(), StoreError> {
        park(&self.conn(), id, next_ms, error)
    }
}
