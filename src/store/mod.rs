//! The SQLite cache: the only module that writes SQL.
//!
//! One file (default `/var/lib/edgehub/edgehub.db`), mode 0600, WAL, `synchronous=FULL`.
//! Objects are kept as the raw JSON the apiserver sent, beside a few indexed columns
//! ([`ObjectIndex`]). Writes happen only when an object really changed, because the device's
//! flash wears out and the budget is ≤ 100 KiB/hour at steady state.
//!
//! A file that is corrupt, foreign or from a newer edgehub is never touched: [`Store::open`]
//! fails with a [`StoreError`] that says what is wrong, and only an explicit
//! [`OpenMode::ResetCache`] moves it aside.

mod cursors;
mod journal;
mod objects;
mod outbox;
mod requests;
mod schema;
pub mod seal;
mod sources;

pub use journal::{Effects, LogLine, RunningRevision};
pub use objects::{ApplyStats, Change, StoredObject};
pub use outbox::{EventSeries, OutboxRow, QueuedEvent, QueuedStatus, RowKind};
pub use requests::{
    NewRequest, Recorded, RequestKind, RequestRecord, HISTORY_PER_POD, TERMINAL_STATES,
};
pub use schema::{APPLICATION_ID, LATEST as SCHEMA_VERSION};
pub use seal::{DeviceKey, KeySource, SealError};
pub use sources::{CachedSource, CachedToken, SealCounts};

use rusqlite::{Connection, OpenFlags};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

const SQLITE_MAGIC: &[u8; 16] = b"SQLite format 3\0";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database {path}: {reason}; it was left untouched (run `edgehub run --reset-cache` to move it aside and rebuild the cache from the apiserver)")]
    Corrupt { path: PathBuf, reason: String },
    #[error("database {path} belongs to another program (application_id {found:#x}); it was left untouched. Point data_dir elsewhere, or run `edgehub run --reset-cache` to move it aside")]
    Foreign { path: PathBuf, found: i32 },
    #[error("database {path} has schema version {found}, newer than this edgehub understands ({supported}); it was left untouched. Run a newer edgehub, or `edgehub run --reset-cache`")]
    TooNew {
        path: PathBuf,
        found: i64,
        supported: i64,
    },
    #[error("database {path} is locked by another process (is another edgehub running on this data dir? The lock is on the data dir itself: stop that edgehub, or point this one at another data_dir)")]
    Locked { path: PathBuf },
    #[error("database {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("database: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("{0}")]
    Seal(#[from] SealError),
    #[error("object {kind} {namespace}/{name}: {reason}")]
    BadObject {
        kind: &'static str,
        namespace: String,
        name: String,
        reason: String,
    },
}

/// How [`Store::open`] treats the existing file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Open it as it is; refuse anything suspicious.
    Normal,
    /// Start the cache over: a valid edgehub file has its cache tables emptied; a corrupt or
    /// foreign file is renamed to `<name>.bad-<unix time>` (never deleted) and a new one made.
    ResetCache,
}

/// The open database. Calls are short and synchronous; the mutex serializes them.
pub struct Store {
    conn: Mutex<Connection>,
    path: PathBuf,
    /// Held for the life of the store: an exclusive `flock` on the data directory itself
    /// (see [`take_lock`]), so two edgehubs never share one database or one pods directory.
    _lock: File,
    /// Bumped after every write that changed an object, so readers (the pod runtime) react
    /// to changes without polling the database.
    changes: tokio::sync::watch::Sender<u64>,
    /// Bumped when a report (status or Event) is queued, to wake the report sender.
    reports: tokio::sync::watch::Sender<u64>,
    /// Bumped when the sender takes a row off the queue (delivered or dropped), so the
    /// runtime's in-memory copy of the queued statuses knows to read the queue again.
    outbox_taken: std::sync::atomic::AtomicU64,
    /// Bookmark progress waiting to ride along with the next commit ([`cursors`]). Taken
    /// after `conn`, never before.
    cursors: Mutex<cursors::ParkedCursors>,
    /// The device key Secrets and tokens are sealed with ([`seal`]); `None`: in the clear.
    key: Option<DeviceKey>,
}

/// How the cache keeps Secrets and tokens, for `edgehub status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealStatus {
    /// Where the device key came from; `None`: there is none, and they are in the clear.
    pub key: Option<String>,
    pub counts: SealCounts,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
}

impl Store {
    /// Opens (or creates) the database at `path`, creating its directory with mode 0700, with
    /// Secrets and tokens in the clear.
    pub fn open(path: &Path, mode: OpenMode) -> Result<Store, StoreError> {
        Store::open_with(path, mode, None)
    }

    /// As [`Store::open`], sealing Secrets and tokens with `key` when there is one. Rows still
    /// in the clear are sealed now. Rows sealed with another key (a rotation, a wrong key
    /// file) are counted and logged, never an error: they read as not cached, and the
    /// fetcher fetches them again once the link is up.
    pub fn open_with(
        path: &Path,
        mode: OpenMode,
        key: Option<DeviceKey>,
    ) -> Result<Store, StoreError> {
        let mut store = Store::open_unsealed(path, mode)?;
        store.key = key;
        store.seal_on_open()?;
        Ok(store)
    }

    fn open_unsealed(path: &Path, mode: OpenMode) -> Result<Store, StoreError> {
        let io = |source| StoreError::Io {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(io)?;
        }
        let lock = take_lock(path)?;
        repair_modes(path)?;

        match (check_and_open(path), mode) {
            (Ok(store_conn), OpenMode::Normal) => Ok(Store::new(store_conn, path, lock)),
            (Ok(store_conn), OpenMode::ResetCache) => {
                let store = Store::new(store_conn, path, lock);
                store.clear_cache()?;
                tracing::warn!(path = %path.display(), "cache reset: objects and cursors cleared");
                Ok(store)
            }
            (
                Err(
                    e @ (StoreError::Corrupt { .. }
                    | StoreError::Foreign { .. }
                    | StoreError::TooNew { .. }),
                ),
                OpenMode::ResetCache,
            ) => {
                let aside = move_aside(path)?;
                tracing::warn!(error = %e, moved_to = %aside.display(), "cache reset: unusable database moved aside");
                scrub_aside(&aside);
                Ok(Store::new(check_and_open(path)?, path, lock))
            }
            (Err(e), _) => Err(e),
        }
    }

    fn new(conn: Connection, path: &Path, lock: File) -> Store {
        Store {
            conn: Mutex::new(conn),
            path: path.to_path_buf(),
            _lock: lock,
            changes: tokio::sync::watch::channel(0).0,
            reports: tokio::sync::watch::channel(0).0,
            outbox_taken: std::sync::atomic::AtomicU64::new(0),
            cursors: Mutex::new(cursors::ParkedCursors::new(Instant::now())),
            key: None,
        }
    }

    /// With a key: seals what is still in the clear, in one transaction, then empties the WAL
    /// (it held the clear frames) and logs what cannot be read.
    fn seal_on_open(&self) -> Result<(), StoreError> {
        let mut conn = self.conn();
        if let Some(key) = &self.key {
            let tx = conn.transaction()?;
            let n = sources::securely(&tx, || sources::seal_clear_rows(&tx, key))?;
            tx.commit()?;
            if n > 0 {
                truncate_wal(&conn)?;
                tracing::info!(rows = n, key = %key.source, "Secrets and tokens kept in the clear are sealed now");
            }
        }
        let counts = sources::seal_counts(&conn, self.key.as_ref())?;
        drop(conn);
        if counts.unreadable > 0 {
            match &self.key {
                Some(k) => tracing::error!(rows = counts.unreadable, key = %k.source,
                    "cached Secrets or tokens were sealed with another device key (the key was rotated, or this is the wrong key): they cannot be read, the pods that need them wait, and they are fetched again once the link is up"),
                None => tracing::error!(rows = counts.unreadable,
                    "cached Secrets or tokens are sealed, and no device key is configured: they cannot be read, the pods that need them wait, and they are fetched again once the link is up"),
            }
        }
        Ok(())
    }

    /// How Secrets and tokens are kept: the key's source, and the rows by state.
    pub fn seal_status(&self) -> Result<SealStatus, StoreError> {
        Ok(SealStatus {
            key: self.key.as_ref().map(|k| k.source.to_string()),
            counts: sources::seal_counts(&self.conn(), self.key.as_ref())?,
        })
    }

    fn parked(&self) -> MutexGuard<'_, cursors::ParkedCursors> {
        // Poisoned only if a thread panicked holding it; the map is still a valid map.
        self.cursors.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A receiver that changes whenever cached objects (or what pods reference) change.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// A receiver that changes whenever a report is queued.
    pub fn subscribe_reports(&self) -> tokio::sync::watch::Receiver<u64> {
        self.reports.subscribe()
    }

    fn report_queued(&self) {
        self.reports.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn changed(&self, stats: &ApplyStats) {
        if stats.touched() {
            self.notify();
        }
    }

    fn notify(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn conn(&self) -> MutexGuard<'_, Connection> {
        // A poisoned mutex only means another thread panicked while holding it; SQLite's own
        // transaction state is still consistent, so carry on with the connection.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

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

    pub fn cursor(&self, resource: &str) -> Result<Option<String>, StoreError> {
        let rv = objects::cursor(&self.conn(), resource)?;
        if let Some(rv) = &rv {
            self.parked().read(resource, rv);
        }
        Ok(rv)
    }

    /// Stores a cursor on its own; the sync parks bookmark progress with [`Store::park_cursor`].
    pub fn set_cursor(&self, resource: &str, rv: &str) -> Result<(), StoreError> {
        let conn = self.conn();
        objects::set_cursor(&conn, resource, rv)?;
        self.parked().stored(resource, rv);
        Ok(())
    }

    /// `resource` reached `rv` with no object change (a bookmark): the progress waits in
    /// memory, rides along with the next commit, and is written by
    /// [`Store::checkpoint_cursors`] when none comes.
    pub fn park_cursor(&self, resource: &str, rv: &str) {
        self.parked().park(resource, rv);
    }

    /// Writes every parked cursor in one transaction once cursors were last written at least
    /// `every` ago (or when `force`d, at shutdown); returns how many it wrote.
    pub fn checkpoint_cursors(&self, every: Duration, force: bool) -> Result<usize, StoreError> {
        let mut conn = self.conn();
        let Some(batch) = self.parked().due(Instant::now(), every, force) else {
            return Ok(0);
        };
        let tx = conn.transaction()?;
        for (resource, rv) in &batch {
            objects::set_cursor(&tx, resource, rv)?;
        }
        tx.commit()?;
        self.parked().written(&batch, Instant::now());
        Ok(batch.len())
    }

    /// The parked cursors to ride along with a commit about to happen: taken after `conn` is
    /// locked, so no other write can take them meanwhile; `own` is the cursor the commit
    /// writes itself, whose older parked progress is dropped.
    fn ride_along(&self, own: Option<&str>) -> cursors::Batch {
        let mut p = self.parked();
        if let Some(k) = own {
            p.forget(k);
        }
        p.batch()
    }

    /// After a commit that carried `batch` (and `own`, its own cursor).
    fn rode_along(&self, batch: &[(String, String)], own: Option<(&str, &str)>) {
        let mut p = self.parked();
        p.written(batch, Instant::now());
        if let Some((k, rv)) = own {
            p.stored(k, rv);
        }
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
        objects::prune(&mut self.conn(), cursors, scopes)
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
        let stats = objects::apply(&mut conn, kind, changes, cursor, &parked)?;
        if stats.touched() {
            self.rode_along(&parked, cursor);
        }
        drop(conn);
        self.changed(&stats);
        Ok(stats)
    }

    /// Stores the object the apiserver answered one of edgehub's writes with, if it is newer
    /// than the cached copy of the same object (see [`objects::put_if_newer`]).
    pub fn put_if_newer(&self, obj: &StoredObject) -> Result<bool, StoreError> {
        let wrote = objects::put_if_newer(&self.conn(), obj)?;
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
        let stats = objects::replace_all(&mut conn, kind, namespace, items, cursor, &parked)?;
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
        objects::get(&self.conn(), kind, namespace, name)
    }

    pub fn list(&self, kind: crate::object::Kind) -> Result<Vec<StoredObject>, StoreError> {
        objects::list(&self.conn(), kind)
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
            let batch = objects::list_after(
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
        objects::list_index(&self.conn(), kind)
    }

    /// Objects of `kind` whose controlling owner has `owner_uid` (a DaemonSet's revisions).
    pub fn list_owned(
        &self,
        kind: crate::object::Kind,
        owner_uid: &str,
    ) -> Result<Vec<StoredObject>, StoreError> {
        objects::list_owned(&self.conn(), kind, owner_uid)
    }

    pub fn get_by_uid(
        &self,
        kind: crate::object::Kind,
        uid: &str,
    ) -> Result<Option<StoredObject>, StoreError> {
        objects::get_by_uid(&self.conn(), kind, uid)
    }

    /// Records an upgrade or image-pull request in state `Requested`, unless one of the same
    /// kind is still active for that pod (then nothing is written).
    /// Records a request; a new one wakes the readers (the upgrade engine starts it at once).
    pub fn record_request(&self, req: &NewRequest<'_>) -> Result<Recorded, StoreError> {
        let r = requests::record(&mut self.conn(), req)?;
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
        requests::latest(&self.conn(), kind, namespace, name)
    }

    /// Which of these request uids ended without committing (RolledBack, Failed).
    pub fn ended_without_commit(
        &self,
        uids: &[&str],
    ) -> Result<std::collections::HashSet<String>, StoreError> {
        requests::ended_without_commit(&self.conn(), uids)
    }

    /// The pod's active request of `kind`, if one is.
    pub fn active_request(
        &self,
        kind: RequestKind,
        pod_uid: &str,
    ) -> Result<Option<RequestRecord>, StoreError> {
        Ok(requests::active(&self.conn(), kind, pod_uid)?)
    }

    /// Every request not yet in a terminal state, oldest first.
    pub fn active_requests(&self) -> Result<Vec<RequestRecord>, StoreError> {
        requests::active_all(&self.conn())
    }

    /// Moves a request to `state` (the upgrade engine's transitions).
    pub fn set_request_state(
        &self,
        id: i64,
        state: &str,
        error: Option<&str>,
    ) -> Result<(), StoreError> {
        requests::set_state(&self.conn(), id, state, error)
    }

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
        let moved = journal::transition(
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
            if effects.running.is_some() {
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
        journal::set_ready_since(&self.conn(), id, state, since)
    }

    /// Sets the deadline of request `id` in `state`, on this boot's clock.
    pub fn set_request_deadline(
        &self,
        id: i64,
        state: &str,
        deadline_ms: Option<i64>,
    ) -> Result<bool, StoreError> {
        requests::set_deadline(&self.conn(), id, state, deadline_ms)
    }

    /// Records why request `id` cannot go on now; writes only when that changes.
    pub fn set_request_waiting(&self, id: i64, waiting: Option<&str>) -> Result<(), StoreError> {
        requests::set_waiting(&self.conn(), id, waiting)
    }

    pub fn request(&self, id: i64) -> Result<Option<RequestRecord>, StoreError> {
        journal::get(&self.conn(), id)
    }

    /// The transitions of request `id`, oldest first.
    pub fn request_log(&self, id: i64) -> Result<Vec<LogLine>, StoreError> {
        journal::log(&self.conn(), id)
    }

    /// The revision a pod runs on the device, when an upgrade committed one its cached pod
    /// object does not have yet.
    pub fn running_revision(&self, pod_uid: &str) -> Result<Option<RunningRevision>, StoreError> {
        journal::running_revision(&self.conn(), pod_uid)
    }

    pub fn running_revisions(&self) -> Result<Vec<RunningRevision>, StoreError> {
        journal::running_revisions(&self.conn())
    }

    /// Per pod uid, the newest revision whose images a pre-pull put on the node.
    pub fn pulled_revisions(&self) -> Result<HashMap<String, String>, StoreError> {
        Ok(journal::pulled(&self.conn())?.into_iter().collect())
    }

    /// Whether a pre-pull of this pod's revision was ever requested.
    pub fn pull_requested(&self, pod_uid: &str, to_hash: &str) -> Result<bool, StoreError> {
        journal::pull_requested(&self.conn(), pod_uid, to_hash)
    }

    /// The pod object of a running revision was deleted so that its replacement adopts it.
    pub fn mark_awaiting_adoption(&self, pod_uid: &str) -> Result<(), StoreError> {
        journal::mark_awaiting(&self.conn(), pod_uid, crate::time::now_ms())?;
        self.notify();
        Ok(())
    }

    /// The pod object was not deleted after all: its sandbox is the pod's again.
    /// Pod uid -> since when (unix ms) the cache no longer holds the pod object of a sandbox
    /// awaiting adoption: the adopt timeout counts from then.
    pub fn deletions_seen(&self, now_ms: i64) -> Result<HashMap<String, i64>, StoreError> {
        journal::deletions_seen(&self.conn(), now_ms)
    }

    /// Whether a DaemonSet is gone from a cache that has listed its namespace's DaemonSets.
    pub fn daemonset_gone(&self, namespace: &str, owner_uid: &str) -> Result<bool, StoreError> {
        journal::daemonset_gone(&self.conn(), namespace, owner_uid)
    }

    pub fn unmark_awaiting_adoption(&self, pod_uid: &str) -> Result<(), StoreError> {
        journal::unmark_awaiting(&self.conn(), pod_uid)?;
        self.notify();
        Ok(())
    }

    /// Binds `pod_uid` to the CRI objects labelled `label_uid` (delete-and-adopt).
    pub fn adopt(&self, label_uid: &str, pod_uid: &str) -> Result<(), StoreError> {
        journal::adopt(&mut self.conn(), label_uid, pod_uid, crate::time::now_ms())?;
        self.notify();
        Ok(())
    }

    /// Label uid -> the pod its CRI objects belong to, for adopted sandboxes.
    pub fn pod_aliases(&self) -> Result<HashMap<String, String>, StoreError> {
        Ok(journal::aliases(&self.conn())?.into_iter().collect())
    }

    pub fn forget_aliases_of(&self, pod_uid: &str) -> Result<(), StoreError> {
        journal::forget_aliases_of(&self.conn(), pod_uid)
    }

    pub fn forget_running_revision(&self, pod_uid: &str) -> Result<(), StoreError> {
        journal::forget_running_revision(&self.conn(), pod_uid)?;
        self.notify();
        Ok(())
    }

    /// Queues a pod status patch (replacing an older one for the same pod). Returns whether
    /// anything was written: an unchanged status costs no write.
    /// Queues the status edgehub wants a pod to have; returns whether it was written.
    pub fn queue_status(&self, q: &QueuedStatus) -> Result<bool, StoreError> {
        let wrote = outbox::queue_status(&mut self.conn(), q, crate::time::now_ms())?;
        if wrote {
            self.report_queued();
        }
        Ok(wrote)
    }

    pub fn queued_statuses(&self) -> Result<Vec<QueuedStatus>, StoreError> {
        outbox::queued_statuses(&self.conn())
    }

    /// Takes a pod's status off the queue: `Some(status)` only if it is still that one.
    pub fn unqueue_status(&self, pod_uid: &str, status: Option<&str>) -> Result<(), StoreError> {
        outbox::unqueue_status(&self.conn(), pod_uid, status)
    }

    pub fn put_source(&self, s: &CachedSource) -> Result<bool, StoreError> {
        let changed = sources::put_source(&self.conn(), s, self.key.as_ref())?;
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
        sources::get_source(&self.conn(), kind, namespace, name, self.key.as_ref())
    }

    pub fn source_keys(&self) -> Result<Vec<(String, String, String)>, StoreError> {
        sources::source_keys(&self.conn())
    }

    pub fn delete_source(&self, kind: &str, namespace: &str, name: &str) -> Result<(), StoreError> {
        sources::delete_source(&self.conn(), kind, namespace, name)
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
        sources::securely(&tx, || {
            for t in tokens {
                sources::put_token(&tx, t, self.key.as_ref())?;
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
        sources::get_token(
            &self.conn(),
            pod_uid,
            audience,
            expiration_secs,
            self.key.as_ref(),
        )
    }

    /// Drops the tokens of pods not in `keep`; returns how many rows went.
    pub fn retain_tokens(&self, keep: &[&str]) -> Result<usize, StoreError> {
        sources::retain_tokens(&self.conn(), keep)
    }

    /// Queues a Warning Event; the same key again counts one more occurrence.
    pub fn queue_event(&self, e: &QueuedEvent, now_ms: i64) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        outbox::queue_event(&tx, e, now_ms)?;
        tx.commit()?;
        drop(conn);
        self.report_queued();
        Ok(())
    }

    /// The series of the Event `row` carries, as the device keeps it.
    pub fn event_series(&self, row: &OutboxRow) -> Result<Option<EventSeries>, StoreError> {
        outbox::event_series(&self.conn(), row)
    }

    /// Forgets the Event series of pods that are gone and owe nothing; returns how many.
    pub fn prune_event_series(&self) -> Result<usize, StoreError> {
        outbox::prune_event_series(&self.conn())
    }

    pub fn queued_events(&self) -> Result<Vec<QueuedEvent>, StoreError> {
        outbox::queued_events(&self.conn())
    }

    /// The rows to send, in order (parked ones too, tried again when due).
    pub fn outbox(&self) -> Result<Vec<OutboxRow>, StoreError> {
        outbox::rows(&self.conn())
    }

    /// The earliest retry time after `now_ms` among the rows waiting for one.
    pub fn outbox_next_attempt_after(&self, now_ms: i64) -> Result<Option<i64>, StoreError> {
        outbox::next_attempt_after(&self.conn(), now_ms)
    }

    /// The parked rows: refused for good, kept with their error.
    pub fn outbox_parked(&self) -> Result<Vec<OutboxRow>, StoreError> {
        outbox::parked(&self.conn())
    }

    /// Rows queued and parked.
    pub fn outbox_counts(&self) -> Result<(u64, u64), StoreError> {
        outbox::counts(&self.conn())
    }

    /// A row was delivered as `sent` was (what changed meanwhile stays queued).
    pub fn outbox_delivered(&self, sent: &OutboxRow) -> Result<(), StoreError> {
        outbox::delivered(&mut self.conn(), sent)?;
        self.took_from_outbox();
        Ok(())
    }

    pub fn outbox_drop(&self, id: i64) -> Result<(), StoreError> {
        outbox::drop_row(&self.conn(), id)?;
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
        outbox::retry(&self.conn(), id, next_ms, error)
    }

    pub fn outbox_park(&self, id: i64, next_ms: i64, error: &str) -> Result<(), StoreError> {
        outbox::park(&self.conn(), id, next_ms, error)
    }

    pub fn count(&self, kind: crate::object::Kind) -> Result<u64, StoreError> {
        objects::count(&self.conn(), kind)
    }

    fn clear_cache(&self) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        tx.execute_batch("DELETE FROM objects; DELETE FROM sync_cursors;")?;
        sources::securely(&tx, || {
            Ok(tx.execute_batch("DELETE FROM pod_sources; DELETE FROM sa_tokens;")?)
        })?;
        tx.commit()?;
        // The WAL held the deleted rows' frames; a reset is rare, so empty it now.
        truncate_wal(&conn)?;
        Ok(())
    }
}

/// Locks the directory the database is in (the data dir) with an exclusive `flock`, held
/// by the open directory for the life of the store.
///
/// Not a side file: a lock on `edgehub.db.lock` was defeated by deleting that file (the
/// natural reaction to "locked by another process"), and the next edgehub locked a new file
/// of the same name. A directory cannot be deleted while it holds the database. Not the
/// database file either: SQLite takes POSIX record locks on it, and closing any descriptor
/// of the file drops every POSIX lock the process holds on it; `flock` locks on the
/// directory are independent of those. The data dir is edgehub's alone (pods' volumes and
/// logs live there too), so one edgehub per data dir is the rule anyway.
fn take_lock(path: &Path) -> Result<File, StoreError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let io = |source| StoreError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
        .map_err(io)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(StoreError::Locked {
                path: path.to_path_buf(),
            })
        }
        Err(std::fs::TryLockError::Error(source)) => return Err(io(source)),
    }
    // The side file an older edgehub locked: if one still runs, it holds it; otherwise it is
    // removed, so nobody deletes it "to unlock" and wonders.
    let mut legacy = path.as_os_str().to_owned();
    legacy.push(".lock");
    let legacy = PathBuf::from(legacy);
    if let Ok(old) = OpenOptions::new().write(true).open(&legacy) {
        if let Err(std::fs::TryLockError::WouldBlock) = old.try_lock() {
            return Err(StoreError::Locked {
                path: path.to_path_buf(),
            });
        }
        if let Err(e) = std::fs::remove_file(&legacy) {
            tracing::warn!(path = %legacy.display(), error = %e, "cannot remove the old lock file");
        }
    }
    Ok(file)
}

/// Makes the data dir 0700 and the database, its WAL and its shared-memory index 0600 again,
/// before SQLite opens them. SQLite reuses a WAL or index it finds, whatever its mode, and
/// creates new ones with the database's mode: a `-wal` left 0644 by a crash after someone
/// with umask 022 touched the files (a `sqlite3` session, a restore) stayed world-readable
/// while edgehub wrote the cache into it, and a data dir that was 0755 before edgehub first
/// ran let anyone list and read the pods' directories. Taken under the lock, so no other
/// edgehub writes meanwhile.
fn repair_modes(path: &Path) -> Result<(), StoreError> {
    let repair = |p: &Path, want: u32| -> Result<(), StoreError> {
        let meta = match std::fs::symlink_metadata(p) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(source) => {
                return Err(StoreError::Io {
                    path: p.to_path_buf(),
                    source,
                })
            }
        };
        let have = meta.permissions().mode() & 0o777;
        // Only what others could read or enter: an owner-only mode stricter than ours (0500
        // on a read-only mount) is left alone.
        if have & 0o077 != 0 {
            tracing::warn!(path = %p.display(), mode = format_args!("{have:o}"),
                want = format_args!("{want:o}"), "readable by others; tightening its mode");
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(want)).map_err(
                |source| StoreError::Io {
                    path: p.to_path_buf(),
                    source,
                },
            )?;
        }
        Ok(())
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        repair(dir, 0o700)?;
    }
    for suffix in ["", "-wal", "-shm"] {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        repair(Path::new(&p), 0o600)?;
    }
    Ok(())
}

/// Checks the file's header, identity, integrity and version, then migrates it.
fn check_and_open(path: &Path) -> Result<Connection, StoreError> {
    let io = |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    };
    let corrupt = |reason: String| StoreError::Corrupt {
        path: path.to_path_buf(),
        reason,
    };
    // Create the file ourselves so it is 0600 from its first byte; SQLite gives the -wal and
    // -shm files the same mode as the database.
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if meta.permissions().mode() & 0o077 != 0 {
        tracing::warn!(path = %path.display(), mode = format_args!("{:o}", meta.permissions().mode() & 0o777), "database was readable by others; setting mode 0600");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    }
    if meta.len() > 0 {
        let mut header = [0u8; 16];
        let n = read_up_to(&mut file, &mut header).map_err(io)?;
        if n < header.len() || &header != SQLITE_MAGIC {
            return Err(corrupt("not an SQLite database (bad header)".into()));
        }
    }
    drop(file);

    let mut conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| classify(path, e))?;
    conn.busy_timeout(Duration::from_secs(2))?;

    let check: String = conn
        .query_row("PRAGMA quick_check(1)", [], |r| r.get(0))
        .map_err(|e| classify(path, e))?;
    if check != "ok" {
        return Err(corrupt(format!("integrity check failed: {check}")));
    }

    let app_id = schema::application_id(&conn).map_err(|e| classify(path, e))?;
    let version = schema::user_version(&conn).map_err(|e| classify(path, e))?;
    let fresh = app_id == 0
        && version == 0
        && schema::schema_object_count(&conn).map_err(|e| classify(path, e))? == 0;
    if !fresh && app_id != schema::APPLICATION_ID {
        return Err(StoreError::Foreign {
            path: path.to_path_buf(),
            found: app_id,
        });
    }
    if version > schema::LATEST {
        return Err(StoreError::TooNew {
            path: path.to_path_buf(),
            found: version,
            supported: schema::LATEST,
        });
    }

    let mode: String = conn
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .map_err(|e| classify(path, e))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(corrupt(format!(
            "cannot switch to WAL (journal_mode={mode})"
        )));
    }
    // cache_size: SQLite's default page cache is 2 MiB, about the size of a device's whole
    // cache file, which the OS page cache holds too. Once the first list has been written the
    // cache is full and stays so, all of it counted in edgehub's RSS: 512 KiB left the idle
    // RSS with 100 pods cached at 8.3 MiB, over the 8 MiB budget (benches/footprint.rs).
    // 64 KiB (16 pages) keeps the schema and the indexes' upper pages; the rest is read from
    // the OS page cache, a few microseconds a page.
    conn.execute_batch("PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON; PRAGMA cache_size=-64;")
        .map_err(|e| classify(path, e))?;
    if let Err(e) = schema::migrate(&mut conn) {
        // A plain SQL error (duplicate column, no such table) means the tables are not what
        // the file's user_version says: say so, name the file, and let --reset-cache move it
        // aside, rather than "database: duplicate column name" with nothing to act on.
        return Err(match e.source.sqlite_error_code() {
            Some(rusqlite::ErrorCode::Unknown) => corrupt(format!(
                "its tables do not match its schema version {}: migrating it to version {} failed: {}",
                e.from,
                e.from + 1,
                e.source
            )),
            _ => classify(path, e.source),
        });
    }
    match schema::verify(&conn).map_err(|e| classify(path, e))? {
        Ok(()) => Ok(conn),
        Err(diff) => Err(corrupt(format!(
            "its tables do not match its schema version {version}: {diff}",
            version = schema::LATEST
        ))),
    }
}

fn read_up_to(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Maps SQLite's codes to the errors a person can act on.
fn classify(path: &Path, e: rusqlite::Error) -> StoreError {
    use rusqlite::ErrorCode::*;
    match e.sqlite_error_code() {
        Some(DatabaseCorrupt | NotADatabase) => StoreError::Corrupt {
            path: path.to_path_buf(),
            reason: e.to_string(),
        },
        Some(DatabaseBusy | DatabaseLocked) => StoreError::Locked {
            path: path.to_path_buf(),
        },
        _ => StoreError::Sqlite(e),
    }
}

/// Writes the WAL back into the database and truncates it to nothing: frames of rows that
/// are gone (or were in the clear) stay in a WAL file until they are overwritten.
fn truncate_wal(conn: &Connection) -> Result<(), StoreError> {
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
    Ok(())
}

/// A moved-aside database is kept for whoever wants to look at it, for good: it must keep no
/// Secret or token in the clear. Sealed rows are no risk and stay; rows in the clear (written
/// without a device key) are deleted from it with `secure_delete`, and its WAL is emptied.
/// An edgehub file only (by its application id): another program's file is left as it is.
/// What cannot be done (the file is too damaged) is logged, naming the file.
fn scrub_aside(aside: &Path) {
    let scrub = || -> rusqlite::Result<Option<usize>> {
        let conn = Connection::open_with_flags(
            aside,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        if schema::application_id(&conn)? != schema::APPLICATION_ID {
            return Ok(None);
        }
        let tables: i64 = conn.query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table'
             AND name IN ('pod_sources', 'sa_tokens')",
            [],
            |r| r.get(0),
        )?;
        if tables < 2 {
            return Ok(None);
        }
        conn.pragma_update(None, "secure_delete", true)?;
        let mut n = conn.execute(
            "DELETE FROM pod_sources WHERE kind = ?1 AND typeof(raw) = 'text'",
            [sources::SEALED_KIND],
        )?;
        n += conn.execute("DELETE FROM sa_tokens WHERE typeof(token) = 'text'", [])?;
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
        Ok(Some(n))
    };
    match scrub() {
        Ok(Some(n)) if n > 0 => tracing::info!(path = %aside.display(), rows = n,
            "Secrets and tokens in the clear deleted from the moved-aside database"),
        Ok(_) => {}
        Err(e) => tracing::warn!(path = %aside.display(), error = %e,
            "the moved-aside database could not be scrubbed: it may hold Secrets or service-account tokens in the clear; delete it once nobody needs it"),
    }
}

/// Renames the database and its WAL/SHM files to `<name>.bad-<unix time>[-wal|-shm]`.
fn move_aside(path: &Path) -> Result<PathBuf, StoreError> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut aside = path.as_os_str().to_owned();
    aside.push(format!(".bad-{secs}"));
    let aside = PathBuf::from(aside);
    for suffix in ["", "-wal", "-shm"] {
        let mut from = path.as_os_str().to_owned();
        from.push(suffix);
        let mut to = aside.as_os_str().to_owned();
        to.push(suffix);
        match std::fs::rename(&from, &to) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(StoreError::Io {
                    path: PathBuf::from(from),
                    source,
                })
            }
        }
    }
    Ok(aside)
}

#[cfg(test)]
mod tests;
