//! Schema and migrations, numbered by `PRAGMA user_version`.
//!
//! Each entry of [`MIGRATIONS`] moves the schema from version `i` to `i + 1` and runs in one
//! transaction with the `user_version` bump, so a power cut leaves the file at one version or
//! the next, never between.

use rusqlite::Connection;

/// `PRAGMA application_id` of an edgehub database ("EDGH"). A non-zero id that differs means
/// the file belongs to some other program, and we refuse to touch it.
pub const APPLICATION_ID: i32 = 0x4544_4748;

const MIGRATIONS: &[&str] = &[
    // 0 -> 1: the object cache and sync cursors.
    "CREATE TABLE objects (
        kind             TEXT NOT NULL,
        namespace        TEXT NOT NULL,
        name             TEXT NOT NULL,
        uid              TEXT NOT NULL,
        resource_version TEXT NOT NULL,
        owner_uid        TEXT,
        owner_kind       TEXT,
        revision_hash    TEXT,
        revision         INTEGER,
        raw              TEXT NOT NULL,
        PRIMARY KEY (kind, namespace, name)
    ) WITHOUT ROWID;
    CREATE INDEX objects_by_uid ON objects (uid);
    CREATE INDEX objects_by_owner ON objects (kind, owner_uid);
    CREATE TABLE sync_cursors (
        resource         TEXT PRIMARY KEY NOT NULL,
        resource_version TEXT NOT NULL
    ) WITHOUT ROWID;",
    // 1 -> 2: deletion marker for PodNeedUpgrade without parsing pods, and upgrade requests
    // (the start of the upgrade journal). The partial unique index makes "one upgrade per pod
    // at a time" a database fact, not a race between two API calls.
    "ALTER TABLE objects ADD COLUMN deleting INTEGER NOT NULL DEFAULT 0;
    CREATE TABLE requests (
        id          INTEGER PRIMARY KEY AUTOINCREMENT,
        kind        TEXT NOT NULL,
        pod_uid     TEXT NOT NULL,
        namespace   TEXT NOT NULL,
        name        TEXT NOT NULL,
        from_hash   TEXT,
        to_hash     TEXT NOT NULL,
        state       TEXT NOT NULL,
        error       TEXT,
        created_ms  INTEGER NOT NULL,
        updated_ms  INTEGER NOT NULL
    );
    CREATE INDEX requests_by_pod ON requests (namespace, name, kind, id);
    CREATE UNIQUE INDEX requests_one_active ON requests (pod_uid, kind)
        WHERE state NOT IN ('Done', 'RolledBack', 'Failed');",
    // 2 -> 3: pod status patches waiting for the link (latest per pod wins). The report
    // issue turns this into the ordered outbox.
    "CREATE TABLE status_queue (
        pod_uid    TEXT PRIMARY KEY NOT NULL,
        namespace  TEXT NOT NULL,
        name       TEXT NOT NULL,
        patch      TEXT NOT NULL,
        queued_ms  INTEGER NOT NULL
    ) WITHOUT ROWID;",
    // 3 -> 4: what pods need from the API besides themselves, kept for offline starts:
    // the ConfigMaps and Secrets they reference (raw JSON as fetched), their service-account
    // tokens, and Events waiting for the link. The file is 0600 in a 0700 directory, as the
    // kubelet keeps the same secrets on disk in its tmpfs-less pod volumes.
    "CREATE TABLE pod_sources (
        kind        TEXT NOT NULL,
        namespace   TEXT NOT NULL,
        name        TEXT NOT NULL,
        raw         TEXT,
        fetched_ms  INTEGER NOT NULL,
        PRIMARY KEY (kind, namespace, name)
    ) WITHOUT ROWID;
    CREATE TABLE sa_tokens (
        pod_uid          TEXT NOT NULL,
        audience         TEXT NOT NULL,
        expiration_secs  INTEGER NOT NULL,
        token            TEXT NOT NULL,
        issued_ms        INTEGER NOT NULL,
        expires_ms       INTEGER NOT NULL,
        PRIMARY KEY (pod_uid, audience, expiration_secs)
    ) WITHOUT ROWID;
    CREATE TABLE event_queue (
        key        TEXT PRIMARY KEY NOT NULL,
        namespace  TEXT NOT NULL,
        body       TEXT NOT NULL,
        queued_ms  INTEGER NOT NULL
    ) WITHOUT ROWID;",
    // 4 -> 5: a queued status is the status edgehub wants (the patch is computed against what
    // the apiserver holds when it is sent, so it can delete an old pod IP); old rows held
    // patches and are dropped (the runtime queues the current status again). Events count
    // their occurrences, for the kubelet's event series.
    "DELETE FROM status_queue;
    ALTER TABLE status_queue RENAME COLUMN patch TO status;
    ALTER TABLE event_queue ADD COLUMN occurrences INTEGER NOT NULL DEFAULT 1;",
    // 5 -> 6: the upgrade journal. A request row carries its state's deadline, since when the
    // new containers have been ready, and the plan fixed when it started; every transition
    // leaves a line in request_log. running_revisions is the runtime map: the revision a pod
    // runs on the device when that is not yet the revision its cached pod object has.
    "ALTER TABLE requests ADD COLUMN deadline_ms INTEGER;
    ALTER TABLE requests ADD COLUMN ready_since_ms INTEGER;
    ALTER TABLE requests ADD COLUMN plan TEXT;
    CREATE TABLE request_log (
        request_id  INTEGER NOT NULL,
        seq         INTEGER NOT NULL,
        state       TEXT NOT NULL,
        at_ms       INTEGER NOT NULL,
        detail      TEXT,
        PRIMARY KEY (request_id, seq)
    ) WITHOUT ROWID;
    CREATE TABLE running_revisions (
        pod_uid       TEXT PRIMARY KEY NOT NULL,
        hash          TEXT NOT NULL,
        images        TEXT NOT NULL,
        committed_ms  INTEGER NOT NULL
    ) WITHOUT ROWID;",
    // 6 -> 7: the revision report by delete-and-adopt. A running revision remembers the pod's
    // namespace and DaemonSet, and since when its pod object was deleted so the DaemonSet
    // controller replaces it; pod_aliases binds a replacement pod to the sandbox and
    // containers labelled with the pod it replaced.
    "ALTER TABLE running_revisions ADD COLUMN namespace TEXT;
    ALTER TABLE running_revisions ADD COLUMN owner_uid TEXT;
    ALTER TABLE running_revisions ADD COLUMN awaiting_since_ms INTEGER;
    CREATE TABLE pod_aliases (
        label_uid  TEXT PRIMARY KEY NOT NULL,
        pod_uid    TEXT NOT NULL,
        since_ms   INTEGER NOT NULL
    ) WITHOUT ROWID;",
    // 7 -> 8: one outbox for everything owed to the apiserver, in order per pod, with each
    // row's attempts, next attempt, last error and whether it is parked. The status and Event
    // queues move into it.
    "CREATE TABLE outbox (
        id               INTEGER PRIMARY KEY AUTOINCREMENT,
        kind             TEXT NOT NULL,
        pod_uid          TEXT NOT NULL,
        namespace        TEXT NOT NULL,
        name             TEXT NOT NULL,
        dedupe           TEXT NOT NULL UNIQUE,
        body             TEXT NOT NULL,
        occurrences      INTEGER NOT NULL DEFAULT 1,
        attempts         INTEGER NOT NULL DEFAULT 0,
        next_attempt_ms  INTEGER NOT NULL DEFAULT 0,
        last_error       TEXT,
        parked           INTEGER NOT NULL DEFAULT 0,
        queued_ms        INTEGER NOT NULL
    );
    CREATE INDEX outbox_by_pod ON outbox (pod_uid, id);
    INSERT INTO outbox (kind, pod_uid, namespace, name, dedupe, body, queued_ms)
        SELECT 'status', pod_uid, namespace, name, 'status/' || pod_uid, status, queued_ms
        FROM status_queue ORDER BY queued_ms;
    INSERT INTO outbox (kind, pod_uid, namespace, name, dedupe, body, occurrences, queued_ms)
        SELECT 'event', COALESCE(json_extract(body, '$.involvedObject.uid'), ''), namespace,
            COALESCE(json_extract(body, '$.metadata.name'), ''), 'event/' || key, body,
            occurrences, queued_ms
        FROM event_queue ORDER BY queued_ms;
    DROP TABLE status_queue;
    DROP TABLE event_queue;",
    // 8 -> 9: sa_tokens becomes a rowid table. In a WITHOUT ROWID table a row keeps at most
    // about 1000 bytes in its b-tree page, so every token (a signed JWT, about 1.1 KB)
    // spilled onto an overflow page of its own: renewing 5 tokens rewrote 8 pages, where
    // rows kept whole in their leaf pages need 2. Renewals are the one write a steady node
    // makes every hour.
    "CREATE TABLE sa_tokens_rowid (
        pod_uid          TEXT NOT NULL,
        audience         TEXT NOT NULL,
        expiration_secs  INTEGER NOT NULL,
        token            TEXT NOT NULL,
        issued_ms        INTEGER NOT NULL,
        expires_ms       INTEGER NOT NULL,
        UNIQUE (pod_uid, audience, expiration_secs)
    );
    INSERT INTO sa_tokens_rowid (pod_uid, audience, expiration_secs, token, issued_ms, expires_ms)
        SELECT pod_uid, audience, expiration_secs, token, issued_ms, expires_ms FROM sa_tokens;
    DROP TABLE sa_tokens;
    ALTER TABLE sa_tokens_rowid RENAME TO sa_tokens;",
    // 9 -> 10: the upgrade journal, made safe against a new database and a wrong clock.
    // - `uid`: the id the CRI objects of an upgrade carry. The rowid restarts at 1 in a new
    //   database while the containers keep running, so a label of a rowid could name an old
    //   upgrade's container as a new one's. Rows from before keep their rowid as uid, which is
    //   what their containers are labelled with.
    // - `clock_boot`: the boot whose CLOCK_BOOTTIME `deadline_ms` and `ready_since_ms` are
    //   measured on (they were wall-clock ms before; rows from before have none, so their
    //   deadlines start afresh, as after a reboot).
    // - `waiting`: why an accepted request cannot go on now, for `GET .../upgrade`.
    "ALTER TABLE requests ADD COLUMN uid TEXT;
    UPDATE requests SET uid = CAST(id AS TEXT);
    CREATE UNIQUE INDEX requests_by_uid ON requests (uid);
    ALTER TABLE requests ADD COLUMN clock_boot TEXT;
    ALTER TABLE requests ADD COLUMN waiting TEXT;",
    // 10 -> 11: an Event series lives on the device. A node may create and patch Events but
    // never read them (403 on GET and LIST), so the count a PATCH sets, the first timestamp
    // and whether the apiserver holds the Event are kept here, one row per Event name, and a
    // row's count is the series' total: sending it twice cannot count twice. Queued Events
    // start their series from what they have; the delivery tokens that were matched against
    // a GET go.
    // (IF NOT EXISTS and OR IGNORE: tests that take a file back to an older version leave
    // the table in place.)
    "CREATE TABLE IF NOT EXISTS event_series (
        key              TEXT PRIMARY KEY NOT NULL,
        pod_uid          TEXT NOT NULL,
        count            INTEGER NOT NULL,
        first_timestamp  TEXT,
        created          INTEGER NOT NULL DEFAULT 0
    ) WITHOUT ROWID;
    INSERT OR IGNORE INTO event_series (key, pod_uid, count, first_timestamp)
        SELECT substr(dedupe, 7), pod_uid, occurrences, json_extract(body, '$.firstTimestamp')
        FROM outbox WHERE kind = 'event';
    UPDATE outbox SET body = json_remove(body, '$.metadata.annotations.\"edgehub.io/delivery\"')
        WHERE kind = 'event';",
    // 11 -> 12: when edgehub saw the pod object of a sandbox awaiting adoption go (its
    // deletion in the cache). The adopt timeout counts from then, not from the DELETE: a
    // link that drops right after the DELETE must not use up the replacement's time. A table
    // of its own, so a file taken back to an older version in a test migrates again.
    // `seen_ms` is on the boot clock of `boot` (time::boot_ms, boot_id): a wall clock that
    // jumps must not expire an adoption at once or hold it off for hours.
    "CREATE TABLE IF NOT EXISTS deletions_seen (
        pod_uid  TEXT PRIMARY KEY NOT NULL,
        seen_ms  INTEGER NOT NULL,
        boot     TEXT NOT NULL DEFAULT ''
    ) WITHOUT ROWID;",
    // 12 -> 13: transactions, upgrades the OTA manager commits or rolls back. A transaction
    // groups upgrade requests (its members, in install order) under one decision (NULL until
    // the manager commits or something rolls it back) and one commit deadline, whose count of
    // time spent Verified (`elapsed_ms`) is kept here, so it survives a reboot: `clock_ms` is
    // the point on the boot clock of `clock_boot` the count was last brought up to (NULL while
    // it does not run). Tables of their own, so existing request rows are untouched.
    "CREATE TABLE IF NOT EXISTS transactions (
        seq                INTEGER PRIMARY KEY AUTOINCREMENT,
        id                 TEXT NOT NULL UNIQUE,
        decision           TEXT,
        reason             TEXT,
        commit_timeout_ms  INTEGER NOT NULL,
        elapsed_ms         INTEGER NOT NULL DEFAULT 0,
        clock_boot         TEXT,
        clock_ms           INTEGER,
        created_ms         INTEGER NOT NULL,
        updated_ms         INTEGER NOT NULL
    );
    CREATE TABLE IF NOT EXISTS transaction_members (
        txn         TEXT NOT NULL,
        position    INTEGER NOT NULL,
        request_id  INTEGER NOT NULL UNIQUE,
        PRIMARY KEY (txn, position)
    ) WITHOUT ROWID;",
];

/// The schema version this binary writes.
pub const LATEST: i64 = MIGRATIONS.len() as i64;

pub fn user_version(conn: &Connection) -> rusqlite::Result<i64> {
    conn.query_row("PRAGMA user_version", [], |r| r.get(0))
}

pub fn application_id(conn: &Connection) -> rusqlite::Result<i32> {
    conn.query_row("PRAGMA application_id", [], |r| r.get(0))
}

/// Number of schema objects; zero means a brand-new, empty file.
pub fn schema_object_count(conn: &Connection) -> rusqlite::Result<i64> {
    conn.query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))
}

/// A migration that failed, and the version it started from.
#[derive(Debug)]
pub struct MigrateError {
    pub from: i64,
    pub source: rusqlite::Error,
}

/// Applies every migration above the file's current version.
pub fn migrate(conn: &mut Connection) -> Result<(), MigrateError> {
    let current = user_version(conn).map_err(|source| MigrateError { from: 0, source })?;
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(current.max(0) as usize) {
        let step = |conn: &mut Connection| -> rusqlite::Result<()> {
            let tx = conn.transaction()?;
            tx.execute_batch(sql)?;
            tx.pragma_update(None, "application_id", APPLICATION_ID)?;
            tx.pragma_update(None, "user_version", (i + 1) as i64)?;
            tx.commit()
        };
        step(conn).map_err(|source| MigrateError {
            from: i as i64,
            source,
        })?;
    }
    Ok(())
}

/// Each table's columns, in order: what a schema is, for comparing two of them.
type Shape = std::collections::BTreeMap<String, Vec<String>>;

fn shape(conn: &Connection) -> rusqlite::Result<Shape> {
    let mut tables = conn.prepare(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'",
    )?;
    let names: Vec<String> = tables
        .query_map([], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    let mut out = Shape::new();
    for t in names {
        let mut cols = conn.prepare("SELECT name FROM pragma_table_info(?1)")?;
        let c: Vec<String> = cols
            .query_map([&t], |r| r.get(0))?
            .collect::<Result<_, _>>()?;
        out.insert(t, c);
    }
    Ok(out)
}

/// The shape every migration leads to, built once per process on an in-memory database.
fn latest_shape() -> rusqlite::Result<&'static Shape> {
    static LATEST_SHAPE: std::sync::OnceLock<Shape> = std::sync::OnceLock::new();
    if let Some(s) = LATEST_SHAPE.get() {
        return Ok(s);
    }
    let mut mem = Connection::open_in_memory()?;
    migrate(&mut mem).map_err(|e| e.source)?;
    Ok(LATEST_SHAPE.get_or_init(|| shape(&mem).unwrap_or_default()))
}

/// Whether the file's tables are what its `user_version` says, after [`migrate`]: a file
/// whose version was set by hand, restored from another build, or written by a tool, would
/// otherwise fail later with "no such column" in the middle of a sync or an upgrade. `Err`
/// says what differs.
pub fn verify(conn: &Connection) -> rusqlite::Result<Result<(), String>> {
    let want = latest_shape()?;
    let have = shape(conn)?;
    for (table, cols) in want {
        match have.get(table) {
            None => return Ok(Err(format!("table {table} is missing"))),
            Some(c) if c != cols => {
                return Ok(Err(format!(
                    "table {table} has columns ({}), schema version {LATEST} has ({})",
                    c.join(", "),
                    cols.join(", ")
                )))
            }
            Some(_) => {}
        }
    }
    if let Some(extra) = have.keys().find(|t| !want.contains_key(*t)) {
        return Ok(Err(format!(
            "table {extra} is not part of schema version {LATEST}"
        )));
    }
    Ok(Ok(()))
}
