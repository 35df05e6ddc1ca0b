//! What pods need from the API besides themselves, kept so they start without a link:
//! referenced ConfigMaps and Secrets, service-account tokens, and Events waiting to be sent.
//!
//! With a device key, a Secret's JSON and a token are stored sealed ([`super::seal`]): a
//! BLOB where the clear value is TEXT, so both can be told apart in one column (SQLite keeps
//! a BLOB as it is in a TEXT column). A sealed value that does not open (another key, or
//! changed bytes) reads as not cached: the pod waits, and the fetcher fetches it again once
//! the link is up. ConfigMaps stay in the clear: they are not secret, and the kubelet keeps
//! them on disk.

use super::objects;
use super::seal::{row_aad, DeviceKey, OpenError};
use super::StoreError;
use rusqlite::types::Value;
use rusqlite::{params, Connection, OptionalExtension};

/// The kind of `pod_sources` row that is sealed.
pub const SEALED_KIND: &str = "secrets";

fn source_aad(kind: &str, namespace: &str, name: &str) -> Vec<u8> {
    row_aad("pod_sources", &[kind, namespace, name])
}

fn token_aad(pod_uid: &str, audience: &str, expiration_secs: i64) -> Vec<u8> {
    row_aad(
        "sa_tokens",
        &[pod_uid, audience, &expiration_secs.to_string()],
    )
}

/// What a stored value reads as.
enum Read {
    Value(String),
    /// Sealed, and it does not open with this key (or there is none).
    Unreadable(OpenError),
}

fn unseal(key: Option<&DeviceKey>, aad: &[u8], v: Value) -> Result<Option<Read>, StoreError> {
    match v {
        Value::Null => Ok(None),
        Value::Text(t) => Ok(Some(Read::Value(t))),
        Value::Blob(b) => match key.map(|k| k.open(aad, &b)) {
            Some(Ok(plain)) => match String::from_utf8(plain) {
                Ok(t) => Ok(Some(Read::Value(t))),
                Err(_) => Ok(Some(Read::Unreadable(OpenError::Damaged))),
            },
            Some(Err(e)) => Ok(Some(Read::Unreadable(e))),
            None => Ok(Some(Read::Unreadable(OpenError::OtherKey))),
        },
        other => Err(StoreError::Sqlite(rusqlite::Error::InvalidColumnType(
            0,
            "sealed or clear value".into(),
            other.data_type(),
        ))),
    }
}

/// Runs `f` with `secure_delete` on: what SQLite frees (a replaced token's cell, a Secret's
/// overflow pages) is overwritten with zeros instead of lingering in the file. On for these
/// tables only: on the object cache it would rewrite every overflow page a pod update frees.
pub fn securely<T>(
    conn: &Connection,
    f: impl FnOnce() -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    conn.pragma_update(None, "secure_delete", true)?;
    let out = f();
    let reset = conn.pragma_update(None, "secure_delete", false);
    let out = out?;
    reset?;
    Ok(out)
}

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
pub fn put_source(
    conn: &Connection,
    s: &CachedSource,
    key: Option<&DeviceKey>,
) -> Result<bool, StoreError> {
    let raw = match (&s.raw, key) {
        (Some(r), Some(k)) if s.kind == SEALED_KIND => {
            Value::Blob(k.seal(&source_aad(&s.kind, &s.namespace, &s.name), r.as_bytes())?)
        }
        (Some(r), _) => Value::Text(r.clone()),
        (None, _) => Value::Null,
    };
    let write = || -> Result<usize, StoreError> {
        Ok(conn
            .prepare_cached(
            "INSERT INTO pod_sources (kind, namespace, name, raw, fetched_ms) VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (kind, namespace, name) DO UPDATE SET raw = excluded.raw, fetched_ms = excluded.fetched_ms
             WHERE raw IS NOT excluded.raw",
            )?
            .execute(params![s.kind, s.namespace, s.name, raw, s.fetched_ms])?)
    };
    let n = if s.kind == SEALED_KIND {
        securely(conn, write)?
    } else {
        write()?
    };
    Ok(n > 0)
}

/// A cached object; `None` also when its sealed value does not open (see the module's doc).
pub fn get_source(
    conn: &Connection,
    kind: &str,
    namespace: &str,
    name: &str,
    key: Option<&DeviceKey>,
) -> Result<Option<CachedSource>, StoreError> {
    let Some((raw, fetched_ms)) = conn
        .prepare_cached(
            "SELECT raw, fetched_ms FROM pod_sources WHERE kind = ?1 AND namespace = ?2 AND name = ?3",
        )?
        .query_row(params![kind, namespace, name], |r| {
            Ok((r.get::<_, Value>(0)?, r.get::<_, i64>(1)?))
        })
        .optional()?
    else {
        return Ok(None);
    };
    let raw = match unseal(key, &source_aad(kind, namespace, name), raw)? {
        None => None,
        Some(Read::Value(v)) => Some(v),
        Some(Read::Unreadable(why)) => {
            tracing::debug!(
                kind,
                namespace,
                name,
                ?why,
                "cached object is sealed and does not open with this device key"
            );
            return Ok(None);
        }
    };
    Ok(Some(CachedSource {
        kind: kind.to_string(),
        namespace: namespace.to_string(),
        name: name.to_string(),
        raw,
        fetched_ms,
    }))
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
    securely(conn, || {
        conn.prepare_cached(
            "DELETE FROM pod_sources WHERE kind = ?1 AND namespace = ?2 AND name = ?3",
        )?
        .execute(params![kind, namespace, name])?;
        Ok(())
    })
}

/// Stores a token, sealed when there is a key. The caller runs it [`securely`].
pub fn put_token(
    conn: &Connection,
    t: &CachedToken,
    key: Option<&DeviceKey>,
) -> Result<(), StoreError> {
    let token = match key {
        Some(k) => Value::Blob(k.seal(
            &token_aad(&t.pod_uid, &t.audience, t.expiration_secs),
            t.token.as_bytes(),
        )?),
        None => Value::Text(t.token.clone()),
    };
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
        token,
        t.issued_ms,
        t.expires_ms
    ])?;
    Ok(())
}

/// A cached token; `None` also when it is sealed and does not open (it is requested anew).
pub fn get_token(
    conn: &Connection,
    pod_uid: &str,
    audience: &str,
    expiration_secs: i64,
    key: Option<&DeviceKey>,
) -> Result<Option<CachedToken>, StoreError> {
    let Some((token, issued_ms, expires_ms)) = conn
        .prepare_cached(
            "SELECT token, issued_ms, expires_ms FROM sa_tokens
             WHERE pod_uid = ?1 AND audience = ?2 AND expiration_secs = ?3",
        )?
        .query_row(params![pod_uid, audience, expiration_secs], |r| {
            Ok((
                r.get::<_, Value>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, i64>(2)?,
            ))
        })
        .optional()?
    else {
        return Ok(None);
    };
    let token = match unseal(key, &token_aad(pod_uid, audience, expiration_secs), token)? {
        Some(Read::Value(v)) => v,
        None => return Ok(None),
        Some(Read::Unreadable(why)) => {
            tracing::debug!(
                pod_uid,
                audience,
                ?why,
                "cached token is sealed and does not open with this device key"
            );
            return Ok(None);
        }
    };
    Ok(Some(CachedToken {
        pod_uid: pod_uid.to_string(),
        audience: audience.to_string(),
        expiration_secs,
        token,
        issued_ms,
        expires_ms,
    }))
}

/// Drops the tokens of pods not in `keep`.
pub fn retain_tokens(conn: &Connection, keep: &[&str]) -> Result<usize, StoreError> {
    let mut stmt = conn.prepare_cached("SELECT DISTINCT pod_uid FROM sa_tokens")?;
    let uids: Vec<String> = stmt
        .query_map([], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    let gone: Vec<&String> = uids
        .iter()
        .filter(|u| !keep.contains(&u.as_str()))
        .collect();
    if gone.is_empty() {
        return Ok(0);
    }
    securely(conn, || {
        let mut n = 0;
        for uid in gone {
            n += conn
                .prepare_cached("DELETE FROM sa_tokens WHERE pod_uid = ?1")?
                .execute(params![uid])?;
        }
        Ok(n)
    })
}

/// How the cache's Secrets and tokens are kept, as the rows say.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SealCounts {
    /// Sealed with the current key.
    pub sealed: u64,
    /// In the clear.
    pub clear: u64,
    /// Sealed with another key (or any key, when there is none now): they read as not cached.
    pub unreadable: u64,
}

/// Counts the Secret and token rows by how they are kept; no value is opened.
pub fn seal_counts(conn: &Connection, key: Option<&DeviceKey>) -> Result<SealCounts, StoreError> {
    let id: Value = match key {
        Some(k) => Value::Blob(k.id().to_vec()),
        None => Value::Null,
    };
    // Bytes 5..13 of a sealed value are its key id (seal::key_id).
    let (sealed, clear, unreadable): (i64, i64, i64) = conn
        .prepare_cached(
            "WITH v(x) AS (SELECT raw FROM pod_sources WHERE kind = ?2 AND raw IS NOT NULL
                           UNION ALL SELECT token FROM sa_tokens)
             SELECT coalesce(sum(typeof(x) = 'blob' AND substr(x, 5, 8) IS ?1), 0),
                    coalesce(sum(typeof(x) = 'text'), 0),
                    coalesce(sum(typeof(x) = 'blob' AND substr(x, 5, 8) IS NOT ?1), 0)
             FROM v",
        )?
        .query_row(params![id, SEALED_KIND], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })?;
    Ok(SealCounts {
        sealed: sealed as u64,
        clear: clear as u64,
        unreadable: unreadable as u64,
    })
}

/// Seals every Secret and token still in the clear (written before a key was configured);
/// returns how many. The caller runs it in a transaction, [`securely`].
pub fn seal_clear_rows(conn: &Connection, key: &DeviceKey) -> Result<usize, StoreError> {
    let secrets: Vec<(String, String, String)> = conn
        .prepare(
            "SELECT namespace, name, raw FROM pod_sources
             WHERE kind = ?1 AND typeof(raw) = 'text'",
        )?
        .query_map(params![SEALED_KIND], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })?
        .collect::<Result<_, _>>()?;
    for (ns, name, raw) in &secrets {
        let sealed = key.seal(&source_aad(SEALED_KIND, ns, name), raw.as_bytes())?;
        conn.execute(
            "UPDATE pod_sources SET raw = ?4 WHERE kind = ?1 AND namespace = ?2 AND name = ?3",
            params![SEALED_KIND, ns, name, sealed],
        )?;
    }
    let tokens: Vec<(i64, String, String, i64, String)> = conn
        .prepare(
            "SELECT rowid, pod_uid, audience, expiration_secs, token FROM sa_tokens
             WHERE typeof(token) = 'text'",
        )?
        .query_map([], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })?
        .collect::<Result<_, _>>()?;
    for (rowid, uid, audience, exp, token) in &tokens {
        let sealed = key.seal(&token_aad(uid, audience, *exp), token.as_bytes())?;
        conn.execute(
            "UPDATE sa_tokens SET token = ?2 WHERE rowid = ?1",
            params![rowid, sealed],
        )?;
    }
    Ok(secrets.len() + tokens.len())
}

impl super::Store {
    pub fn put_source(&self, s: &CachedSource) -> Result<bool, StoreError> {
        let changed = put_source(&self.conn(), s, self.key.as_ref())?;
        if changed {
            self.notify();
        }
        Ok(changed)
    }

    pub fn get_source(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Result<Option<CachedSource>, StoreError> {
        get_source(&self.conn(), kind, namespace, name, self.key.as_ref())
    }

    pub fn source_keys(&self) -> Result<Vec<(String, String, String)>, StoreError> {
        source_keys(&self.conn())
    }

    pub fn delete_source(&self, kind: &str, namespace: &str, name: &str) -> Result<(), StoreError> {
        delete_source(&self.conn(), kind, namespace, name)
    }

    /// Stores a service-account token; subscribers hear of it.
    pub fn put_token(&self, t: &CachedToken) -> Result<(), StoreError> {
        self.put_tokens(std::slice::from_ref(t))
    }

    /// Stores tokens in one transaction (a renewal round: one commit on flash, not one per
    /// pod), parked cursors riding along; subscribers hear of them once.
    pub fn put_tokens(&self, tokens: &[CachedToken]) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let parked = self.ride_along(None);
        let tx = conn.transaction()?;
        securely(&tx, || {
            for t in tokens {
                put_token(&tx, t, self.key.as_ref())?;
            }
            Ok(())
        })?;
        for (resource, rv) in &parked {
            objects::set_cursor(&tx, resource, rv)?;
        }
        tx.commit()?;
        self.rode_along(&parked, None);
        drop(conn);
        self.notify();
        Ok(())
    }

    pub fn get_token(
        &self,
        pod_uid: &str,
        audience: &str,
        expiration_secs: i64,
    ) -> Result<Option<CachedToken>, StoreError> {
        get_token(
            &self.conn(),
            pod_uid,
            audience,
            expiration_secs,
            self.key.as_ref(),
        )
    }

    /// Drops the tokens of pods not in `keep`; returns how many rows went.
    pub fn retain_tokens(&self, keep: &[&str]) -> Result<usize, StoreError> {
        retain_tokens(&self.conn(), keep)
    }
}
