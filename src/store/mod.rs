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
//!
//! Each file holds one part of the schema: its SQL and the `Store` methods over it (`open`:
//! the file itself; `objects`, `cursors`: the cache; `requests`, `journal`: upgrades and the
//! runtime map; `transactions`: upgrades the OTA manager commits; `outbox`: reports;
//! `sources`, `seal`: what pods reference, sealed). This file keeps the type, its errors and
//! the wakeups.

mod cursors;
mod journal;
mod noatime;
mod objects;
mod open;
mod outbox;
mod requests;
mod schema;
pub mod seal;
mod sources;
mod transactions;

pub use journal::{Effects, LogLine, RunningRevision};
pub use objects::{ApplyStats, Change, StoredObject};
pub use outbox::{EventSeries, OutboxRow, QueuedEvent, QueuedStatus, RowKind};
pub use requests::{
    new_uid, NewRequest, Recorded, RequestKind, RequestRecord, HISTORY_PER_POD, TERMINAL_STATES,
};
pub use schema::{APPLICATION_ID, LATEST as SCHEMA_VERSION};
pub use seal::{DeviceKey, KeySource, SealError};
pub use sources::{CachedSource, CachedToken, SealCounts};
pub use transactions::{Decided, Decision, TxnCreated, TxnRecord, TRANSACTIONS_KEPT};

use rusqlite::Connection;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

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
    /// SQLite's count of changed rows as of the last time the connection was given back
    /// ([`Store::generation`]): published before the mutex is released, so reading it never
    /// waits behind a write (a commit's fsync can take milliseconds).
    generation: std::sync::atomic::AtomicU64,
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

    /// A number that moves whenever anything in the file changed through this store: SQLite's
    /// count of the rows inserted, updated or deleted since the connection opened
    /// (`sqlite3_total_changes64`). The store is the file's only writer (its lock on the data
    /// dir), so a view derived from the store (the rendered pod list of `GET /pods`) stays
    /// true for as long as this number does not move, whatever it was derived from.
    ///
    /// It is the count as of the last time the connection was given back, so it never waits
    /// for the connection: a write in progress shows once it is done. That is enough for a
    /// view: a view read before the write and checked against this number after its reads is
    /// kept only if no write was given back in between (the release of the store's mutex
    /// orders the number's update before any later read of the connection), and one whose
    /// reads saw a write finds the number moved.
    pub fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    fn conn(&self) -> Conn<'_> {
        // A poisoned mutex only means another thread panicked while holding it; SQLite's own
        // transaction state is still consistent, so carry on with the connection.
        let guard = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let changes = guard.total_changes();
        Conn {
            guard,
            changes,
            generation: &self.generation,
        }
    }
}

/// The connection while the store's mutex is held. When it is given back after a commit, it
/// reads once, so that the commit's wal-index page takes its read mark now.
///
/// Why: the first read transaction after a commit moves a read mark in the `-shm` file (a
/// shared mapping of a file next to the database) to the commit's last frame. The commit has
/// just dirtied that page, so a read now costs nothing; the kernel writes the page back about
/// 30 s later, and a read after that (the next periodic task's, minutes later) dirtied it
/// again, a 4 KiB flash write of its own per commit. benches/flash.rs saw them as lone 4 KiB
/// writes 40-170 s after each commit, a third of the device's steady-state hour without a
/// key. The read costs two lock calls; it runs only when rows changed.
struct Conn<'a> {
    guard: MutexGuard<'a, Connection>,
    /// SQLite's count of changed rows when the guard was taken.
    changes: u64,
    /// Where the count is published when the guard is given back ([`Store::generation`]).
    generation: &'a std::sync::atomic::AtomicU64,
}

impl std::ops::Deref for Conn<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        &self.guard
    }
}

impl std::ops::DerefMut for Conn<'_> {
    fn deref_mut(&mut self) -> &mut Connection {
        &mut self.guard
    }
}

impl Drop for Conn<'_> {
    fn drop(&mut self) {
        let total = self.guard.total_changes();
        if total == self.changes {
            return;
        }
        // Published while the mutex is still held (the guard field drops after this body).
        self.generation
            .store(total, std::sync::atomic::Ordering::Release);
        // Not inside a transaction a caller left open (nothing is committed yet then), and
        // only when rows changed (a commit, or a statement that committed on its own).
        if !self.guard.is_autocommit() {
            return;
        }
        // Reading the schema's first page is a read transaction of the whole file: it takes
        // the read mark, then ends. A failure only means the mark moves on the next read.
        if let Err(e) = self
            .guard
            .query_row("SELECT 1 FROM sqlite_schema LIMIT 1", [], |_| Ok(()))
        {
            tracing::debug!(error = %e, "reading after a commit failed");
        }
    }
}

/// The database's files: the database itself, then SQLite's `-wal` and `-shm` beside it.
/// Whatever is done to the database on disk (its modes, moving it aside, its access-time
/// flag) is done to all three.
fn database_files(db: &Path) -> [PathBuf; 3] {
    ["", "-wal", "-shm"].map(|suffix| {
        let mut p = db.as_os_str().to_owned();
        p.push(suffix);
        PathBuf::from(p)
    })
}

#[cfg(test)]
mod tests;
