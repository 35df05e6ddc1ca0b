//! What waits for the link: the pod statuses edgehub wants the apiserver to hold, and Warning
//! Events. Producers queue here; the report sender drains while the link is up. Both queues
//! survive restarts. (The report issue folds them into one ordered outbox.)

use super::StoreError;
use rusqlite::{params, Connection};

/// The status edgehub wants a pod to have: its own fields (phase, its conditions, container
/// statuses, IPs), merged onto the status the apiserver held when it was queued. The patch is
/// computed when it is sent, against what the apiserver holds then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedStatus {
    pub pod_uid: String,
    pub namespace: String,
    pub name: String,
    /// The `status` object, JSON.
    pub status: String,
}

/// Queues (or replaces) a pod's wanted status; returns whether anything was written.
pub fn queue_status(conn: &Connection, q: &QueuedStatus, now_ms: i64) -> Result<bool, StoreError> {
    let n = conn
        .prepare_cached(
            "INSERT INTO status_queue (pod_uid, namespace, name, status, queued_ms) VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (pod_uid) DO UPDATE SET status = excluded.status, name = excluded.name,
                 namespace = excluded.namespace, queued_ms = excluded.queued_ms
             WHERE status != excluded.status",
        )?
        .execute(params![q.pod_uid, q.namespace, q.name, q.status, now_ms])?;
    Ok(n > 0)
}

pub fn queued_statuses(conn: &Connection) -> Result<Vec<QueuedStatus>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT pod_uid, namespace, name, status FROM status_queue ORDER BY queued_ms",
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
    match status {
        Some(s) => conn
            .prepare_cached("DELETE FROM status_queue WHERE pod_uid = ?1 AND status = ?2")?
            .execute(params![pod_uid, s])?,
        None => conn
            .prepare_cached("DELETE FROM status_queue WHERE pod_uid = ?1")?
            .execute(params![pod_uid])?,
    };
    Ok(())
}

/// An Event waiting for the link. `key` is the Event's namespace/name: queuing the same key
/// again bumps `occurrences` and replaces the body, the kubelet's event series.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedEvent {
    pub key: String,
    pub namespace: String,
    pub body: String,
    /// How many times it happened since it was last delivered.
    pub occurrences: i64,
}

pub fn queue_event(conn: &Connection, e: &QueuedEvent, now_ms: i64) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO event_queue (key, namespace, body, queued_ms, occurrences) VALUES (?1, ?2, ?3, ?4, 1)
         ON CONFLICT (key) DO UPDATE SET body = excluded.body, occurrences = occurrences + 1",
    )?
    .execute(params![e.key, e.namespace, e.body, now_ms])?;
    Ok(())
}

pub fn queued_events(conn: &Connection) -> Result<Vec<QueuedEvent>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT key, namespace, body, occurrences FROM event_queue ORDER BY queued_ms",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok(QueuedEvent {
            key: r.get(0)?,
            namespace: r.get(1)?,
            body: r.get(2)?,
            occurrences: r.get(3)?,
        })
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// Removes a delivered Event, unless it happened again meanwhile (then only the occurrences
/// delivered are taken off).
pub fn event_sent(conn: &Connection, key: &str, delivered: i64) -> Result<(), StoreError> {
    conn.prepare_cached("DELETE FROM event_queue WHERE key = ?1 AND occurrences <= ?2")?
        .execute(params![key, delivered])?;
    conn.prepare_cached(
        "UPDATE event_queue SET occurrences = occurrences - ?2 WHERE key = ?1 AND occurrences > ?2",
    )?
    .execute(params![key, delivered])?;
    Ok(())
}
