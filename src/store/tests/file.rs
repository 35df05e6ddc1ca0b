//! Opening the file: modes, the lock, what is refused and left untouched, resets, migrations.

use super::*;

#[test]
fn fresh_file_is_created_0600_in_wal_mode() {
    let (_d, path) = db();
    let store = Store::open(&path, OpenMode::Normal).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let dir_mode = std::fs::metadata(path.parent().unwrap())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(dir_mode, 0o700);
    let conn = store.conn();
    let jm: String = conn
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(jm, "wal");
    assert_eq!(schema::user_version(&conn).unwrap(), schema::LATEST);
    assert_eq!(schema::application_id(&conn).unwrap(), APPLICATION_ID);
}

#[test]
fn reopen_keeps_data() {
    let (_d, path) = db();
    {
        let s = Store::open(&path, OpenMode::Normal).unwrap();
        s.replace_all(Kind::Pod, None, &[pod("a", "1")], ("pods", "10"))
            .unwrap();
    }
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    assert_eq!(s.count(Kind::Pod).unwrap(), 1);
    assert_eq!(s.cursor("pods").unwrap().as_deref(), Some("10"));
    assert_eq!(s.get(Kind::Pod, "ns", "a").unwrap().unwrap(), pod("a", "1"));
}

#[test]
fn second_open_is_locked() {
    let (_d, path) = db();
    let _s = Store::open(&path, OpenMode::Normal).unwrap();
    let err = Store::open(&path, OpenMode::Normal).unwrap_err();
    assert!(matches!(err, StoreError::Locked { .. }), "{err}");
    assert!(err.to_string().contains("another edgehub"));
}

#[test]
fn deleting_lock_files_does_not_let_a_second_store_in() {
    let (_d, path) = db();
    let _s = Store::open(&path, OpenMode::Normal).unwrap();
    // What a person does on "locked by another process": delete whatever looks like a lock.
    for e in std::fs::read_dir(path.parent().unwrap()).unwrap() {
        let e = e.unwrap();
        if e.file_name().to_string_lossy().ends_with(".lock") {
            std::fs::remove_file(e.path()).unwrap();
        }
    }
    let err = Store::open(&path, OpenMode::Normal).unwrap_err();
    assert!(matches!(err, StoreError::Locked { .. }), "{err}");
    // Another database file in the same data dir is refused too: the pods directory there is
    // one edgehub's.
    let err = Store::open(&path.with_file_name("other.db"), OpenMode::Normal).unwrap_err();
    assert!(matches!(err, StoreError::Locked { .. }), "{err}");
}

#[test]
fn an_old_lock_file_is_honoured_while_held_and_removed_when_not() {
    let (_d, path) = db();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let legacy = path.with_file_name("edgehub.db.lock");
    let old = File::create(&legacy).unwrap();
    old.lock().unwrap();
    let err = Store::open(&path, OpenMode::Normal).unwrap_err();
    assert!(matches!(err, StoreError::Locked { .. }), "{err}");
    drop(old);
    let _s = Store::open(&path, OpenMode::Normal).unwrap();
    assert!(!legacy.exists(), "the unheld old lock file is removed");
}

#[test]
fn garbage_file_is_corrupt_and_untouched() {
    let (_d, path) = db();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let garbage = b"this is not a database, it is a shopping list\n".repeat(100);
    std::fs::write(&path, &garbage).unwrap();
    let err = Store::open(&path, OpenMode::Normal).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("--reset-cache"));
    assert_eq!(std::fs::read(&path).unwrap(), garbage);
}

#[test]
fn damaged_pages_are_corrupt() {
    let (_d, path) = db();
    {
        let s = Store::open(&path, OpenMode::Normal).unwrap();
        let items: Vec<_> = (0..200).map(|i| pod(&format!("p{i}"), "1")).collect();
        s.replace_all(Kind::Pod, None, &items, ("pods", "1"))
            .unwrap();
        s.conn()
            .execute_batch("PRAGMA wal_checkpoint(TRUNCATE)")
            .unwrap();
    }
    // Keep the header, trash everything after the first page.
    let mut bytes = std::fs::read(&path).unwrap();
    assert!(bytes.len() > 8192);
    for b in &mut bytes[4096..] {
        *b = 0xA5;
    }
    std::fs::write(&path, &bytes).unwrap();
    let err = Store::open(&path, OpenMode::Normal).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        bytes,
        "file must be untouched"
    );
}

#[test]
fn foreign_sqlite_file_is_refused() {
    let (_d, path) = db();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch("CREATE TABLE recipes (name TEXT); INSERT INTO recipes VALUES ('soup');")
            .unwrap();
    }
    let before = std::fs::read(&path).unwrap();
    let err = Store::open(&path, OpenMode::Normal).unwrap_err();
    assert!(matches!(err, StoreError::Foreign { .. }), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

#[test]
fn newer_schema_is_refused() {
    let (_d, path) = db();
    {
        let s = Store::open(&path, OpenMode::Normal).unwrap();
        s.conn()
            .pragma_update(None, "user_version", schema::LATEST + 5)
            .unwrap();
    }
    let err = Store::open(&path, OpenMode::Normal).unwrap_err();
    assert!(matches!(err, StoreError::TooNew { .. }), "{err}");
}

#[test]
fn a_user_version_that_does_not_match_the_tables_is_named_and_reset_recovers() {
    let (_d, path) = db();
    {
        let s = Store::open(&path, OpenMode::Normal).unwrap();
        s.replace_all(Kind::Pod, None, &[pod("a", "1")], ("pods", "10"))
            .unwrap();
        // The tables are at the latest version; the version says 5 (set by hand, or a file
        // restored from another build): migrating 5 -> 6 adds columns that exist.
        s.conn().pragma_update(None, "user_version", 5).unwrap();
    }
    let before = std::fs::read(&path).unwrap();
    let err = Store::open(&path, OpenMode::Normal).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{msg}");
    assert!(
        msg.contains(&path.display().to_string())
            && msg.contains("do not match its schema version 5")
            && msg.contains("duplicate column name")
            && msg.contains("--reset-cache"),
        "{msg}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), before, "left untouched");
    let s = Store::open(&path, OpenMode::ResetCache).unwrap();
    assert_eq!(s.count(Kind::Pod).unwrap(), 0);
    assert_eq!(schema::user_version(&s.conn()).unwrap(), schema::LATEST);
    drop(s);
    assert!(
        std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .filter_map(|e| e.ok())
            .any(|e| e.file_name().to_string_lossy().contains(".bad-")),
        "the mismatched file was moved aside"
    );

    // The latest version with a table missing would fail later, mid-sync, with "no such
    // table": it is refused at open.
    {
        let s = Store::open(&path, OpenMode::Normal).unwrap();
        s.conn().execute_batch("DROP TABLE request_log").unwrap();
    }
    let err = Store::open(&path, OpenMode::Normal).unwrap_err();
    assert!(
        matches!(err, StoreError::Corrupt { .. })
            && err.to_string().contains("table request_log is missing"),
        "{err}"
    );
}

#[test]
fn reset_cache_moves_a_corrupt_file_aside() {
    let (_d, path) = db();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, b"garbage garbage garbage garbage").unwrap();
    let s = Store::open(&path, OpenMode::ResetCache).unwrap();
    assert_eq!(s.count(Kind::Pod).unwrap(), 0);
    let aside: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".bad-"))
        .collect();
    assert_eq!(aside.len(), 1);
    assert_eq!(
        std::fs::read(aside[0].path()).unwrap(),
        b"garbage garbage garbage garbage"
    );
}

#[test]
fn reset_cache_empties_a_valid_file() {
    let (_d, path) = db();
    {
        let s = Store::open(&path, OpenMode::Normal).unwrap();
        s.replace_all(Kind::Pod, None, &[pod("a", "1")], ("pods", "10"))
            .unwrap();
    }
    let s = Store::open(&path, OpenMode::ResetCache).unwrap();
    assert_eq!(s.count(Kind::Pod).unwrap(), 0);
    assert_eq!(s.cursor("pods").unwrap(), None);
}

#[test]
fn loose_permissions_are_tightened() {
    let (_d, path) = db();
    drop(Store::open(&path, OpenMode::Normal).unwrap());
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    drop(Store::open(&path, OpenMode::Normal).unwrap());
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
}

#[test]
fn a_version_1_file_is_migrated_in_place() {
    let (_d, path) = db();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    {
        // What edgehub's first schema looked like, with a pod in it.
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch(&format!(
            "PRAGMA application_id = {APPLICATION_ID}; PRAGMA user_version = 1;
             CREATE TABLE objects (kind TEXT NOT NULL, namespace TEXT NOT NULL, name TEXT NOT NULL,
               uid TEXT NOT NULL, resource_version TEXT NOT NULL, owner_uid TEXT, owner_kind TEXT,
               revision_hash TEXT, revision INTEGER, raw TEXT NOT NULL,
               PRIMARY KEY (kind, namespace, name)) WITHOUT ROWID;
             CREATE INDEX objects_by_uid ON objects (uid);
             CREATE INDEX objects_by_owner ON objects (kind, owner_uid);
             CREATE TABLE sync_cursors (resource TEXT PRIMARY KEY NOT NULL, resource_version TEXT NOT NULL) WITHOUT ROWID;
             INSERT INTO objects VALUES ('Pod','ns','a','uid-a','1',NULL,NULL,NULL,NULL,'{{}}');"
        ))
        .unwrap();
    }
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    assert_eq!(schema::user_version(&s.conn()).unwrap(), schema::LATEST);
    let a = s.get(Kind::Pod, "ns", "a").unwrap().unwrap();
    assert!(!a.index.deleting);
}

#[test]
fn tokens_keep_across_the_move_to_a_rowid_table_and_a_renewal_rewrites_two_pages() {
    let (_d, path) = db();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let token = |i: usize, issued: i64| CachedToken {
        pod_uid: format!("pod-{i}"),
        audience: String::new(),
        expiration_secs: 3607,
        token: format!("{issued}-{i}-").repeat(400)[..1100].to_string(),
        issued_ms: issued,
        expires_ms: issued + 3_607_000,
    };
    {
        let s = Store::open(&path, OpenMode::Normal).unwrap();
        let c = s.conn();
        // Back to version 8, with its WITHOUT ROWID table and a token in it (and without
        // what later versions added to the requests).
        c.execute_batch(
            "DROP INDEX requests_by_uid;
             ALTER TABLE requests DROP COLUMN uid;
             ALTER TABLE requests DROP COLUMN clock_boot;
             ALTER TABLE requests DROP COLUMN waiting;
             DROP TABLE sa_tokens;
             CREATE TABLE sa_tokens (pod_uid TEXT NOT NULL, audience TEXT NOT NULL,
               expiration_secs INTEGER NOT NULL, token TEXT NOT NULL, issued_ms INTEGER NOT NULL,
               expires_ms INTEGER NOT NULL, PRIMARY KEY (pod_uid, audience, expiration_secs))
               WITHOUT ROWID;
             PRAGMA user_version = 8;",
        )
        .unwrap();
        sources::put_token(&c, &token(0, 1), None).unwrap();
    }
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    assert_eq!(schema::user_version(&s.conn()).unwrap(), schema::LATEST);
    assert_eq!(s.get_token("pod-0", "", 3607).unwrap(), Some(token(0, 1)));
    let round = |issued| (0..5).map(|i| token(i, issued)).collect::<Vec<_>>();
    s.put_tokens(&round(1)).unwrap();
    assert_eq!(s.get_token("pod-3", "", 3607).unwrap(), Some(token(3, 1)));
    // WAL frames written since an emptied WAL: what a commit costs on flash.
    let checkpoint = |s: &Store, mode: &str| -> i64 {
        s.conn()
            .query_row(&format!("PRAGMA wal_checkpoint({mode})"), [], |r| r.get(1))
            .unwrap()
    };
    checkpoint(&s, "TRUNCATE");
    s.put_tokens(&round(2)).unwrap();
    assert_eq!(s.get_token("pod-3", "", 3607).unwrap(), Some(token(3, 2)));
    assert_eq!(
        checkpoint(&s, "PASSIVE"),
        2,
        "5 renewed tokens are two WAL frames"
    );
}

#[test]
fn queued_events_start_their_series_when_the_file_is_migrated() {
    let (_d, path) = db();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    {
        let s = Store::open(&path, OpenMode::Normal).unwrap();
        let c = s.conn();
        // Back to version 10: no series; an Event queued twice, with the delivery token the
        // sender used to match against a GET.
        c.execute_batch(
            "DROP TABLE event_series;
             INSERT INTO outbox (kind, pod_uid, namespace, name, dedupe, body, occurrences, queued_ms)
             VALUES ('event', 'u1', 'ns', 'p.edgehub-upgradestarted', 'event/ns/p.edgehub-upgradestarted',
                 '{\"metadata\":{\"name\":\"p.edgehub-upgradestarted\",\"annotations\":{\"edgehub.io/delivery\":\"ab12\"}},\"firstTimestamp\":\"t0\"}',
                 2, 1);
             PRAGMA user_version = 10;",
        )
        .unwrap();
    }
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    assert_eq!(schema::user_version(&s.conn()).unwrap(), schema::LATEST);
    let row = s.outbox().unwrap().remove(0);
    assert!(!row.body.contains("edgehub.io/delivery"), "{}", row.body);
    assert_eq!(
        s.event_series(&row).unwrap(),
        Some(EventSeries {
            count: 2,
            first_timestamp: Some("t0".into()),
            created: false
        })
    );
}

/// The wal-index (`-shm`, a shared mapping of a file on the data dir's file system) as SQLite
/// lays it out: the header's `mxFrame` at byte 16, the checkpoint info's read marks 1-4 at
/// bytes 104-119 (mark 0 is the "read the database alone" slot, always 0).
fn wal_index_marks(path: &Path) -> (u32, Vec<u32>) {
    let mut shm = path.as_os_str().to_owned();
    shm.push("-shm");
    let bytes = std::fs::read(shm).unwrap();
    let word = |at: usize| u32::from_ne_bytes(bytes[at..at + 4].try_into().unwrap());
    (word(16), (1..5).map(|i| word(100 + 4 * i)).collect())
}

/// The first read after a commit moves a read mark to the commit's last frame, a write into
/// the wal-index's first page. Done by whichever read came next, it landed minutes later,
/// after the kernel had written the commit's dirty page back, and cost a page of flash of its
/// own (benches/flash.rs: lone 4 KiB writes 40-170 s after each commit, a third of the
/// steady-state hour without a device key). The store reads once right after each commit, so
/// the mark moves while the page is still dirty and the next read finds it in place.
#[test]
fn a_commit_leaves_the_wal_index_read_mark_at_its_last_frame() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    for rv in ["1", "2", "3"] {
        s.replace_all(Kind::Pod, None, &[pod("a", rv)], ("pods", rv))
            .unwrap();
        let (max_frame, marks) = wal_index_marks(&path);
        assert!(max_frame > 0, "the write went to the WAL");
        assert!(
            marks.contains(&max_frame),
            "after commit {rv}: no read mark at the last frame {max_frame}: {marks:?}"
        );
    }
}

/// A read of the WAL after a commit wrote the inode once more for its access time alone
/// (relatime: the WAL is newer than its last read), minutes after the commit's own writes had
/// gone out: a lone 4 KiB write per commit in benches/flash.rs. The store's files keep no
/// access time. The access time is set back first, so that relatime would update it.
#[test]
fn reading_the_database_files_leaves_their_access_time() {
    use std::os::unix::fs::MetadataExt;
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    s.replace_all(Kind::Pod, None, &[pod("a", "1")], ("pods", "1"))
        .unwrap();
    let past = std::time::SystemTime::now() - Duration::from_secs(3600);
    for p in super::super::database_files(&path) {
        let f = std::fs::File::options().write(true).open(&p).unwrap();
        f.set_times(std::fs::FileTimes::new().set_accessed(past))
            .unwrap();
        drop(f);
        let before = std::fs::metadata(&p).unwrap().atime();
        std::fs::read(&p).unwrap();
        let after = std::fs::metadata(&p).unwrap().atime();
        assert_eq!(
            before,
            after,
            "{}: the read wrote its access time",
            p.display()
        );
    }
    let dir = path.parent().unwrap();
    let before = std::fs::metadata(dir).unwrap().atime();
    std::fs::File::create(dir.join("new")).unwrap();
    std::fs::read_dir(dir).unwrap().for_each(drop);
    assert_eq!(
        before,
        std::fs::metadata(dir).unwrap().atime(),
        "listing the data dir wrote its access time"
    );
}
