//! Typed queries over the `objects` and `sync_cursors` tables.

use super::StoreError;
use crate::object::{Kind, ObjectIndex};
use rusqlite::{params, Connection, OptionalExtension, Row};
use std::collections::HashSet;

/// One cached object: its index columns and the raw JSON exactly as the apiserver sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredObject {
    pub index: ObjectIndex,
    pub raw: String,
}

impl StoredObject {
    /// Indexes `raw` as an object of `kind`.
    pub fn from_raw(kind: Kind, raw: String) -> Result<StoredObject, crate::object::ObjectError> {
        Ok(StoredObject {
            index: ObjectIndex::from_raw(kind, &raw)?,
            raw,
        })
    }
}

/// One change from a watch stream.
#[derive(Debug, Clone)]
pub enum Change {
    Upsert(StoredObject),
    Delete { namespace: String, name: String },
}

/// What a write did; `written == 0 && deleted == 0` means the disk was not touched.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyStats {
    pub written: usize,
    pub deleted: usize,
    pub unchanged: usize,
}

impl ApplyStats {
    pub fn touched(&self) -> bool {
        self.written + self.deleted > 0
    }
}

const COLUMNS: &str = "kind, namespace, name, uid, resource_version, owner_uid, owner_kind, revision_hash, revision, raw, deleting";

fn row_to_object(row: &Row<'_>) -> rusqlite::Result<(String, StoredObject)> {
    let kind: String = row.get(0)?;
    let index = ObjectIndex {
        // Placeholder, fixed up by the caller, which knows which kinds are valid.
        kind: Kind::Pod,
        namespace: row.get(1)?,
        name: row.get(2)?,
        uid: row.get(3)?,
        resource_version: row.get(4)?,
        owner_uid: row.get(5)?,
        owner_kind: row.get(6)?,
        revision_hash: row.get(7)?,
        revision: row.get(8)?,
        deleting: row.get(10)?,
    };
    Ok((
        kind,
        StoredObject {
            index,
            raw: row.get(9)?,
        },
    ))
}

fn fix_kind((kind, mut obj): (String, StoredObject)) -> Result<StoredObject, StoreError> {
    obj.index.kind = Kind::parse(&kind).ok_or_else(|| StoreError::BadObject {
        kind: "?",
        namespace: obj.index.namespace.clone(),
        name: obj.index.name.clone(),
        reason: format!("unknown kind {kind:?} in the objects table"),
    })?;
    Ok(obj)
}

pub fn get(
    conn: &Connection,
    kind: Kind,
    namespace: &str,
    name: &str,
) -> Result<Option<StoredObject>, StoreError> {
    let sql =
        format!("SELECT {COLUMNS} FROM objects WHERE kind = ?1 AND namespace = ?2 AND name = ?3");
    conn.prepare_cached(&sql)?
        .query_row(params![kind.as_str(), namespace, name], row_to_object)
        .optional()?
        .map(fix_kind)
        .transpose()
}

pub fn list(conn: &Connection, kind: Kind) -> Result<Vec<StoredObject>, StoreError> {
    let sql = format!("SELECT {COLUMNS} FROM objects WHERE kind = ?1 ORDER BY namespace, name");
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt.query_map(params![kind.as_str()], row_to_object)?;
    rows.map(|r| fix_kind(r?)).collect()
}

/// Up to `limit` objects of `kind` after `(namespace, name)` (from the start when `None`), in
/// the order of [`list`].
pub fn list_after(
    conn: &Connection,
    kind: Kind,
    after: Option<(&str, &str)>,
    limit: usize,
) -> Result<Vec<StoredObject>, StoreError> {
    let sql = format!(
        "SELECT {COLUMNS} FROM objects WHERE kind = ?1 AND (?2 IS NULL OR (namespace, name) > (?2, ?3))
         ORDER BY namespace, name LIMIT ?4"
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let (ns, name) = after.unzip();
    let rows = stmt.query_map(
        params![kind.as_str(), ns, name, limit as i64],
        row_to_object,
    )?;
    rows.map(|r| fix_kind(r?)).collect()
}

/// The index of every object of `kind`, without reading the JSON (an empty `raw`).
pub fn list_index(conn: &Connection, kind: Kind) -> Result<Vec<ObjectIndex>, StoreError> {
    let sql = format!(
        "SELECT {} FROM objects WHERE kind = ?1 ORDER BY namespace, name",
        COLUMNS.replace("raw,", "'' AS raw,")
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt.query_map(params![kind.as_str()], row_to_object)?;
    rows.map(|r| fix_kind(r?).map(|o| o.index)).collect()
}

pub fn list_owned(
    conn: &Connection,
    kind: Kind,
    owner_uid: &str,
) -> Result<Vec<StoredObject>, StoreError> {
    let sql = format!(
        "SELECT {COLUMNS} FROM objects WHERE kind = ?1 AND owner_uid = ?2 ORDER BY namespace, name"
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt.query_map(params![kind.as_str(), owner_uid], row_to_object)?;
    rows.map(|r| fix_kind(r?)).collect()
}

pub fn get_by_uid(
    conn: &Connection,
    kind: Kind,
    uid: &str,
) -> Result<Option<StoredObject>, StoreError> {
    let sql = format!("SELECT {COLUMNS} FROM objects WHERE uid = ?1 AND kind = ?2");
    conn.prepare_cached(&sql)?
        .query_row(params![uid, kind.as_str()], row_to_object)
        .optional()?
        .map(fix_kind)
        .transpose()
}

pub fn count(conn: &Connection, kind: Kind) -> Result<u64, StoreError> {
    let n: i64 = conn
        .prepare_cached("SELECT count(*) FROM objects WHERE kind = ?1")?
        .query_row(params![kind.as_str()], |r| r.get(0))?;
    Ok(n.max(0) as u64)
}

pub fn cursor(conn: &Connection, resource: &str) -> Result<Option<String>, StoreError> {
    Ok(conn
        .prepare_cached("SELECT resource_version FROM sync_cursors WHERE resource = ?1")?
        .query_row(params![resource], |r| r.get(0))
        .optional()?)
}

pub fn set_cursor(conn: &Connection, resource: &str, rv: &str) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO sync_cursors (resource, resource_version) VALUES (?1, ?2)
         ON CONFLICT (resource) DO UPDATE SET resource_version = excluded.resource_version
         WHERE resource_version != excluded.resource_version",
    )?
    .execute(params![resource, rv])?;
    Ok(())
}

pub fn prune(
    conn: &mut Connection,
    cursors: &[String],
    scopes: &[(Kind, &[String])],
) -> Result<usize, StoreError> {
    let stale_cursors: Vec<String> = {
        let mut stmt = conn.prepare_cached("SELECT resource FROM sync_cursors")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        rows.filter(|r| r.as_ref().map_or(true, |k| !cursors.contains(k)))
            .collect::<Result<_, _>>()?
    };
    let mut stale_namespaces: Vec<(Kind, String)> = Vec::new();
    for (kind, keep) in scopes.iter().filter(|(_, keep)| !keep.is_empty()) {
        let mut stmt =
            conn.prepare_cached("SELECT DISTINCT namespace FROM objects WHERE kind = ?1")?;
        for ns in stmt.query_map(params![kind.as_str()], |r| r.get::<_, String>(0))? {
            let ns = ns?;
            if !keep.contains(&ns) {
                stale_namespaces.push((*kind, ns));
            }
        }
    }
    if stale_cursors.is_empty() && stale_namespaces.is_empty() {
        return Ok(0);
    }
    let tx = conn.transaction()?;
    let mut n = 0;
    for key in &stale_cursors {
        n += tx
            .prepare_cached("DELETE FROM sync_cursors WHERE resource = ?1")?
            .execute(params![key])?;
    }
    for (kind, ns) in &stale_namespaces {
        n += tx
            .prepare_cached("DELETE FROM objects WHERE kind = ?1 AND namespace = ?2")?
            .execute(params![kind.as_str(), ns])?;
    }
    tx.commit()?;
    Ok(n)
}

/// The stored resourceVersion and raw JSON of one object, for change detection.
fn current(
    conn: &Connection,
    kind: Kind,
    namespace: &str,
    name: &str,
) -> rusqlite::Result<Option<(String, String)>> {
    conn.prepare_cached(
        "SELECT resource_version, raw FROM objects WHERE kind = ?1 AND namespace = ?2 AND name = ?3",
    )?
    .query_row(params![kind.as_str(), namespace, name], |r| {
        Ok((r.get(0)?, r.get(1)?))
    })
    .optional()
}

/// Whether resourceVersion `a` is newer than `b`. Resource versions are etcd revisions, and
/// Kubernetes made them comparable as integers (KEP-5504); one that is not an integer is never
/// taken as newer, so a foreign server can only make edgehub wait for its watch.
pub fn rv_newer(a: &str, b: &str) -> bool {
    match (a.parse::<u64>(), b.parse::<u64>()) {
        (Ok(a), Ok(b)) => a > b,
        _ => false,
    }
}

/// Stores `obj` (an answer to edgehub's own write) if the cached copy is the same object at an
/// older resourceVersion. Returns whether it was written. A watch event for the same version
/// arriving later is then a no-op, and one for a newer version still wins.
pub fn put_if_newer(conn: &Connection, obj: &StoredObject) -> Result<bool, StoreError> {
    let ix = &obj.index;
    let cur: Option<(String, String)> = conn
        .prepare_cached(
            "SELECT uid, resource_version FROM objects WHERE kind = ?1 AND namespace = ?2 AND name = ?3",
        )?
        .query_row(params![ix.kind.as_str(), ix.namespace, ix.name], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .optional()?;
    match cur {
        Some((uid, rv)) if uid == ix.uid && rv_newer(&ix.resource_version, &rv) => {
            upsert(conn, obj)?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

fn upsert(conn: &Connection, obj: &StoredObject) -> rusqlite::Result<()> {
    let ix = &obj.index;
    conn.prepare_cached(
        "INSERT INTO objects (kind, namespace, name, uid, resource_version, owner_uid, owner_kind,
                              revision_hash, revision, raw, deleting)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)
         ON CONFLICT (kind, namespace, name) DO UPDATE SET
            uid = excluded.uid, resource_version = excluded.resource_version,
            owner_uid = excluded.owner_uid, owner_kind = excluded.owner_kind,
            revision_hash = excluded.revision_hash, revision = excluded.revision,
            raw = excluded.raw, deleting = excluded.deleting",
    )?
    .execute(params![
        ix.kind.as_str(),
        ix.namespace,
        ix.name,
        ix.uid,
        ix.resource_version,
        ix.owner_uid,
        ix.owner_kind,
        ix.revision_hash,
        ix.revision,
        obj.raw,
        ix.deleting
    ])?;
    Ok(())
}

fn delete(conn: &Connection, kind: Kind, namespace: &str, name: &str) -> rusqlite::Result<usize> {
    conn.prepare_cached("DELETE FROM objects WHERE kind = ?1 AND namespace = ?2 AND name = ?3")?
        .execute(params![kind.as_str(), namespace, name])
}

/// Unchanged: the same version, or for a Node a newer one that only moved heartbeat times
/// ([`crate::object::node_heartbeat_only`]; the row keeps its older version and raw JSON).
fn is_unchanged(conn: &Connection, obj: &StoredObject) -> rusqlite::Result<bool> {
    let ix = &obj.index;
    Ok(match current(conn, ix.kind, &ix.namespace, &ix.name)? {
        Some((rv, raw)) if rv == ix.resource_version && raw == obj.raw => true,
        Some((_, raw)) if ix.kind == Kind::Node => {
            crate::object::node_heartbeat_only(&raw, &obj.raw)
        }
        _ => false,
    })
}

/// Applies `changes`, writing only what changed; the transaction (if there is one) also
/// writes `cursor` and the `parked` cursors riding along.
pub fn apply(
    conn: &mut Connection,
    kind: Kind,
    changes: &[Change],
    cursor: Option<(&str, &str)>,
    parked: &[(String, String)],
) -> Result<ApplyStats, StoreError> {
    // Decide first, outside any write transaction, so that no-op events cost no disk write.
    let mut stats = ApplyStats::default();
    let mut todo = Vec::with_capacity(changes.len());
    for change in changes {
        match change {
            Change::Upsert(obj) => {
                if obj.index.kind != kind {
                    return Err(mismatch(kind, obj));
                }
                if is_unchanged(conn, obj)? {
                    stats.unchanged += 1;
                } else {
                    todo.push(change);
                }
            }
            Change::Delete { namespace, name } => {
                if current(conn, kind, namespace, name)?.is_some() {
                    todo.push(change);
                } else {
                    stats.unchanged += 1;
                }
            }
        }
    }
    if todo.is_empty() {
        return Ok(stats);
    }
    let tx = conn.transaction()?;
    for change in todo {
        match change {
            Change::Upsert(obj) => {
                upsert(&tx, obj)?;
                stats.written += 1;
            }
            Change::Delete { namespace, name } => {
                stats.deleted += delete(&tx, kind, namespace, name)?;
            }
        }
    }
    for (resource, rv) in parked {
        set_cursor(&tx, resource, rv)?;
    }
    if let Some((resource, rv)) = cursor {
        set_cursor(&tx, resource, rv)?;
    }
    tx.commit()?;
    Ok(stats)
}

pub fn replace_all(
    conn: &mut Connection,
    kind: Kind,
    namespace: Option<&str>,
    items: &[StoredObject],
    (resource, rv): (&str, &str),
    parked: &[(String, String)],
) -> Result<ApplyStats, StoreError> {
    let mut stats = ApplyStats::default();
    let tx = conn.transaction()?;
    let mut keep: HashSet<(&str, &str)> = HashSet::with_capacity(items.len());
    for obj in items {
        if obj.index.kind != kind || namespace.is_some_and(|ns| ns != obj.index.namespace) {
            return Err(mismatch(kind, obj));
        }
        keep.insert((&obj.index.namespace, &obj.index.name));
        if is_unchanged(&tx, obj)? {
            stats.unchanged += 1;
        } else {
            upsert(&tx, obj)?;
            stats.written += 1;
        }
    }
    let stale: Vec<(String, String)> = {
        let mut stmt = tx.prepare_cached(
            "SELECT namespace, name FROM objects WHERE kind = ?1 AND (?2 IS NULL OR namespace = ?2)",
        )?;
        let rows = stmt.query_map(params![kind.as_str(), namespace], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })?;
        let mut stale = Vec::new();
        for row in rows {
            let (ns, name): (String, String) = row?;
            if !keep.contains(&(ns.as_str(), name.as_str())) {
                stale.push((ns, name));
            }
        }
        stale
    };
    for (ns, name) in &stale {
        stats.deleted += delete(&tx, kind, ns, name)?;
    }
    for (k, v) in parked {
        set_cursor(&tx, k, v)?;
    }
    set_cursor(&tx, resource, rv)?;
    tx.commit()?;
    Ok(stats)
}

fn mismatch(kind: Kind, obj: &StoredObject) -> StoreError {
    StoreError::BadObject {
        kind: obj.index.kind.as_str(),
        namespace: obj.index.namespace.clone(),
        name: obj.index.name.clone(),
        reason: format!("does not belong to the {kind} set being written"),
    }
}

impl super::Store {
    /// The stored resourceVersion of a watched resource, if any.
    /// Whether a pod list has completed since the cache was created (a pods cursor exists):
    /// only then does a pod missing from it mean the pod is gone. A store holds one node.
    pub fn pod_list_seen(&self) -> Result<bool, StoreError> {
        Ok(self
            .conn()
            .prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM sync_cursors WHERE resource LIKE 'pods?%')",
            )?
            .query_row([], |r| r.get(0))?)
    }

    /// Forgets what the current sync selection no longer covers: cursors whose key is not in
    /// `cursors` (another node name, other namespaces), and objects of each `(kind, namespaces)`
    /// scope outside those namespaces (an empty list keeps all). Returns the rows deleted;
    /// writes nothing when there is nothing to forget.
    pub fn prune(
        &self,
        cursors: &[String],
        scopes: &[(crate::object::Kind, &[String])],
    ) -> Result<usize, StoreError> {
        prune(&mut self.conn(), cursors, scopes)
    }

    /// Applies watch events of one kind; writes only what changed, with the cursor in the
    /// same transaction. No change means no transaction and no disk write at all.
    pub fn apply(
        &self,
        kind: crate::object::Kind,
        changes: &[Change],
        cursor: Option<(&str, &str)>,
    ) -> Result<ApplyStats, StoreError> {
        let mut conn = self.conn();
        let parked = self.ride_along(cursor.map(|c| c.0));
        let stats = apply(&mut conn, kind, changes, cursor, &parked)?;
        if stats.touched() {
            self.rode_along(&parked, cursor);
        }
        drop(conn);
        self.changed(&stats);
        Ok(stats)
    }

    /// Stores the object the apiserver answered one of edgehub's writes with, if it is newer
    /// than the cached copy of the same object (see [`put_if_newer`]).
    pub fn put_if_newer(&self, obj: &StoredObject) -> Result<bool, StoreError> {
        let wrote = put_if_newer(&self.conn(), obj)?;
        if wrote {
            self.notify();
        }
        Ok(wrote)
    }

    /// Replaces every object of `kind` (in `namespace`, or all of them) with `items` in one
    /// transaction (after a list), deleting rows the server no longer has, and stores the list's
    /// resourceVersion as the cursor. Unchanged objects are not rewritten.
    pub fn replace_all(
        &self,
        kind: crate::object::Kind,
        namespace: Option<&str>,
        items: &[StoredObject],
        cursor: (&str, &str),
    ) -> Result<ApplyStats, StoreError> {
        let mut conn = self.conn();
        let parked = self.ride_along(Some(cursor.0));
        let stats = replace_all(&mut conn, kind, namespace, items, cursor, &parked)?;
        self.rode_along(&parked, Some(cursor));
        drop(conn);
        self.changed(&stats);
        Ok(stats)
    }

    pub fn get(
        &self,
        kind: crate::object::Kind,
        namespace: &str,
        name: &str,
    ) -> Result<Option<StoredObject>, StoreError> {
        get(&self.conn(), kind, namespace, name)
    }

    pub fn list(&self, kind: crate::object::Kind) -> Result<Vec<StoredObject>, StoreError> {
        list(&self.conn(), kind)
    }

    /// Every object of `kind`, handed to `f` `chunk` at a time, in the order of
    /// [`Store::list`], the database free between chunks. For work that needs each object's
    /// JSON once and keeps little of it: at most `chunk` objects are in memory, where a
    /// whole list of 100 pods is 550 KiB, and on musl's allocator a peak stays resident.
    pub fn for_each_chunk(
        &self,
        kind: crate::object::Kind,
        chunk: usize,
        mut f: impl FnMut(Vec<StoredObject>),
    ) -> Result<(), StoreError> {
        let chunk = chunk.max(1);
        let mut after: Option<(String, String)> = None;
        loop {
            let batch = list_after(
                &self.conn(),
                kind,
                after.as_ref().map(|(ns, n)| (ns.as_str(), n.as_str())),
                chunk,
            )?;
            let Some(last) = batch.last() else {
                return Ok(());
            };
            let last = (last.index.namespace.clone(), last.index.name.clone());
            let full = batch.len() == chunk;
            f(batch);
            if !full {
                return Ok(());
            }
            after = Some(last);
        }
    }

    /// The indexed fields of every object of `kind`, for callers that decide from them
    /// alone: reading 1000 pods' JSON (5.5 MB) for their indexes, every second, kept that much
    /// heap in use and fragmented.
    pub fn list_index(
        &self,
        kind: crate::object::Kind,
    ) -> Result<Vec<crate::object::ObjectIndex>, StoreError> {
        list_index(&self.conn(), kind)
    }

    /// Objects of `kind` whose controlling owner has `owner_uid` (a DaemonSet's revisions).
    pub fn list_owned(
        &self,
        kind: crate::object::Kind,
        owner_uid: &str,
    ) -> Result<Vec<StoredObject>, StoreError> {
        list_owned(&self.conn(), kind, owner_uid)
    }

    pub fn get_by_uid(
        &self,
        kind: crate::object::Kind,
        uid: &str,
    ) -> Result<Option<StoredObject>, StoreError> {
        get_by_uid(&self.conn(), kind, uid)
    }

    pub fn count(&self, kind: crate::object::Kind) -> Result<u64, StoreError> {
        count(&self.conn(), kind)
    }
}
