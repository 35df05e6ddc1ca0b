//! What pods need from the API besides themselves, kept so they start without a link:
//! referenced ConfigMaps and Secrets, service-account tokens, and Events waiting to be sent.

use super::StoreError;
use rusqlite::{params, Connection, OptionalExtension};

/// A referenced ConfigMap or Secret as last fetched. `raw` is `None` when the apiserver said
/// it does not exist: an optional reference is then satisfied, a required one is not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedSource {
    pub kind: String,
    pub namespace: String,
    pub name: String,
    pub raw: Option<String>,
    pub fetched_ms: i64,
}

/// A projected service-account token for one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedToken {
    pub pod_uid: String,
    pub audience: String,
    pub expiration_secs: i64,
    pub token: String,
    pub issued_ms: i64,
    pub expires_ms: i64,
}

/// Stores a fetch result; returns whether anything changed. An unchanged object is not
/// rewritten at all (flash wear): how fresh it is lives in the fetcher's memory.
pub fn put_source(conn: &Connection, s: &CachedSource) -> Result<bool, StoreError> {
    let n = conn
        .prepare_cached(
            "INSERT INTO pod_sources (kind, namespace, name, raw, fetched_ms) VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (kind, namespace, name) DO UPDATE SET raw = excluded.raw, fetched_ms = excluded.fetched_ms
             WHERE raw IS NOT excluded.raw",
        )?
        .execute(params![s.kind, s.namespace, s.name, s.raw, s.fetched_ms])?;
    Ok(n > 0)
}

pub fn get_source(
    conn: &Connection,
    kind: &str,
    namespace: &str,
    name: &str,
) -> Result<Option<CachedSource>, StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT raw, fetched_ms FROM pod_sources WHERE kind = ?1 AND namespace = ?2 AND name = ?3",
        )?
        .query_row(params![kind, namespace, name], |r| {
            Ok(CachedSource {
                kind: kind.to_string(),
                namespace: namespace.to_string(),
                name: name.to_string(),
                raw: r.get(0)?,
                fetched_ms: r.get(1)?,
            })
        })
        .optional()?)
}

/// Every cached source's key, for pruning what no pod references any more.
pub fn source_keys(conn: &Connection) -> Result<Vec<(String, String, String)>, StoreError> {
    let mut stmt = conn.prepare_cached("SELECT kind, namespace, name FROM pod_sources")?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
    Ok(rows.collect::<Result<_, _>>()?)
}

pub fn delete_source(
    conn: &Connection,
    kind: &str,
    namespace: &str,
    name: &str,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "DELETE FROM pod_sources WHERE kind = ?1 AND namespace = ?2 AND name = ?3",
    )?
    .execute(params![kind, namespace, name])?;
    Ok(())
}

pub fn put_token(conn: &Connection, t: &CachedToken) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO sa_tokens (pod_uid, audience, expiration_secs, token, issued_ms, expires_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)
         ON CONFLICT (pod_uid, audience, expiration_secs) DO UPDATE SET
           token = excluded.token, issued_ms = excluded.issued_ms, expires_ms = excluded.expires_ms",
    )?
    .execute(params![
        t.pod_uid,
        t.audience,
        t.expiration_secs,
        t.token,
        t.issued_ms,
        t.expires_ms
    ])?;
    Ok(())
}

pub fn get_token(
    conn: &Connection,
    pod_uid: &str,
    audience: &str,
    expiration_secs: i64,
) -> Result<Option<CachedToken>, StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT token, issued_ms, expires_ms FROM sa_tokens
             WHERE pod_uid = ?1 AND audience = ?2 AND expiration_secs = ?3",
        )?
        .query_row(params![pod_uid, audience, expiration_secs], |r| {
            Ok(CachedToken {
                pod_uid: pod_uid.to_string(),
                audience: audience.to_string(),
                expiration_secs,
                token: r.get(0)?,
                issued_ms: r.get(1)?,
                expires_ms: r.get(2)?,
            })
        })
        .optional()?)
}

/// Drops the tokens of pods not in `keep`.
pub fn retain_tokens(conn: &Connection, keep: &[&str]) -> Result<usize, StoreError> {
    let mut stmt = conn.prepare_cached("SELECT DISTINCT pod_uid FROM sa_tokens")?;
    let uids: Vec<String> = stmt
        .query_map([], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    let mut n = 0;
    for uid in uids.iter().filter(|u| !keep.contains(&u.as_str())) {
        n += conn
            .prepare_cached("DELETE FROM sa_tokens WHERE pod_uid = ?1")?
            .execute(params![uid])?;
    }
    Ok(n)
}
