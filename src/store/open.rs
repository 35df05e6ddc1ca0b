//! Opening the file: the data dir's lock, file modes, what a file that is not ours or is
//! damaged gets (left untouched, or moved aside on an explicit reset), the schema, and the
//! device key that seals Secrets and tokens.

use super::{
    cursors, noatime, schema, sources, DeviceKey, OpenMode, SealStatus, Store, StoreError,
};
use rusqlite::{Connection, OpenFlags};
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const SQLITE_MAGIC: &[u8; 16] = b"SQLite format 3\0";

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
        // Before SQLite opens the files: closing any other descriptor of a file drops every
        // POSIX lock the process holds on it, SQLite's included (a reader in another process
        // then took the index for abandoned and rebuilt it under edgehub; tests/cli.rs's
        // second-connection readers saw no rows). A database, WAL or index made later gets
        // the flag from the directory.
        noatime::apply(path);

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
            generation: std::sync::atomic::AtomicU64::new(conn.total_changes()),
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
    for p in super::database_files(path) {
        repair(&p, 0o600)?;
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
    // The page cache's bound before the first read (see below): the integrity check reads
    // every page, and with SQLite's default 2 MiB cache they all stayed until the bound came.
    conn.execute_batch("PRAGMA cache_size=-64;")
        .map_err(|e| classify(path, e))?;

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
    for (from, to) in super::database_files(path)
        .into_iter()
        .zip(super::database_files(&aside))
    {
        match std::fs::rename(&from, &to) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(StoreError::Io { path: from, source }),
        }
    }
    Ok(aside)
}
