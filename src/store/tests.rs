use super::*;
use crate::object::Kind;
use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

fn pod(name: &str, rv: &str) -> StoredObject {
    let raw = format!(
        r#"{{"metadata":{{"name":"{name}","namespace":"ns","uid":"uid-{name}","resourceVersion":"{rv}"}}}}"#
    );
    StoredObject::from_raw(Kind::Pod, raw).unwrap()
}

fn db() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/edgehub.db");
    (dir, path)
}

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
fn apply_skips_unchanged_objects_without_writing() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let st = s
        .apply(
            Kind::Pod,
            &[Change::Upsert(pod("a", "1"))],
            Some(("pods", "1")),
        )
        .unwrap();
    assert_eq!(st.written, 1);
    let changes_before = s.conn().total_changes();
    let st = s
        .apply(
            Kind::Pod,
            &[Change::Upsert(pod("a", "1"))],
            Some(("pods", "2")),
        )
        .unwrap();
    assert_eq!(
        st,
        ApplyStats {
            written: 0,
            deleted: 0,
            unchanged: 1
        }
    );
    assert_eq!(s.conn().total_changes(), changes_before, "no row written");
    // The cursor travels only with real changes.
    assert_eq!(s.cursor("pods").unwrap().as_deref(), Some("1"));
    let st = s
        .apply(
            Kind::Pod,
            &[
                Change::Upsert(pod("a", "3")),
                Change::Delete {
                    namespace: "ns".into(),
                    name: "zz".into(),
                },
            ],
            Some(("pods", "3")),
        )
        .unwrap();
    assert_eq!(
        st,
        ApplyStats {
            written: 1,
            deleted: 0,
            unchanged: 1
        }
    );
    assert_eq!(s.cursor("pods").unwrap().as_deref(), Some("3"));
    let st = s
        .apply(
            Kind::Pod,
            &[Change::Delete {
                namespace: "ns".into(),
                name: "a".into(),
            }],
            None,
        )
        .unwrap();
    assert_eq!(st.deleted, 1);
    assert_eq!(s.count(Kind::Pod).unwrap(), 0);
}

#[test]
fn replace_all_deletes_what_the_server_no_longer_has() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    s.replace_all(
        Kind::Pod,
        None,
        &[pod("a", "1"), pod("b", "1"), pod("c", "1")],
        ("pods", "5"),
    )
    .unwrap();
    // Other kinds are not touched by a pod relist.
    let node = StoredObject::from_raw(
        Kind::Node,
        r#"{"metadata":{"name":"n","uid":"un","resourceVersion":"1"}}"#.into(),
    )
    .unwrap();
    s.apply(Kind::Node, &[Change::Upsert(node)], None).unwrap();
    let st = s
        .replace_all(
            Kind::Pod,
            None,
            &[pod("b", "1"), pod("c", "7")],
            ("pods", "9"),
        )
        .unwrap();
    assert_eq!(
        st,
        ApplyStats {
            written: 1,
            deleted: 1,
            unchanged: 1
        }
    );
    let names: Vec<_> = s
        .list(Kind::Pod)
        .unwrap()
        .into_iter()
        .map(|o| o.index.name)
        .collect();
    assert_eq!(names, ["b", "c"]);
    assert_eq!(s.count(Kind::Node).unwrap(), 1);
    assert_eq!(s.cursor("pods").unwrap().as_deref(), Some("9"));
}

#[test]
fn kind_mismatch_is_an_error() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let err = s
        .apply(Kind::Node, &[Change::Upsert(pod("a", "1"))], None)
        .unwrap_err();
    assert!(matches!(err, StoreError::BadObject { .. }));
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
fn replace_all_in_one_namespace_leaves_the_others() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let other = StoredObject::from_raw(
        Kind::Pod,
        r#"{"metadata":{"name":"o","namespace":"other","uid":"uo","resourceVersion":"1"}}"#.into(),
    )
    .unwrap();
    s.apply(Kind::Pod, &[Change::Upsert(other.clone())], None)
        .unwrap();
    s.replace_all(Kind::Pod, Some("ns"), &[pod("a", "1")], ("pods@ns", "3"))
        .unwrap();
    assert_eq!(s.count(Kind::Pod).unwrap(), 2);
    s.replace_all(Kind::Pod, Some("ns"), &[], ("pods@ns", "4"))
        .unwrap();
    assert_eq!(s.list(Kind::Pod).unwrap(), vec![other.clone()]);
    // An item from another namespace is refused.
    assert!(s
        .replace_all(Kind::Pod, Some("ns"), &[other], ("pods@ns", "5"))
        .is_err());
}

#[test]
fn prune_forgets_other_selections_only() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let ds = |ns: &str, name: &str| {
        StoredObject::from_raw(
            Kind::DaemonSet,
            format!(r#"{{"metadata":{{"name":"{name}","namespace":"{ns}","uid":"u{ns}{name}","resourceVersion":"1"}}}}"#),
        )
        .unwrap()
    };
    s.replace_all(
        Kind::DaemonSet,
        None,
        &[ds("vehicle", "a"), ds("infra", "b")],
        ("daemonsets.apps", "5"),
    )
    .unwrap();
    s.replace_all(
        Kind::Pod,
        None,
        &[pod("p", "1")],
        ("pods?fieldSelector=spec.nodeName=old", "5"),
    )
    .unwrap();
    let keep = vec!["daemonsets.apps@vehicle".to_string()];
    let vehicle = vec!["vehicle".to_string()];
    let n = s
        .prune(&keep, &[(Kind::DaemonSet, &vehicle), (Kind::Pod, &[])])
        .unwrap();
    assert_eq!(n, 3, "two cursors and one DaemonSet");
    assert_eq!(s.count(Kind::DaemonSet).unwrap(), 1);
    assert_eq!(
        s.count(Kind::Pod).unwrap(),
        1,
        "an empty scope keeps every namespace"
    );
    assert_eq!(s.cursor("daemonsets.apps").unwrap(), None);
    let before = s.conn().total_changes();
    assert_eq!(s.prune(&keep, &[(Kind::DaemonSet, &vehicle)]).unwrap(), 0);
    assert_eq!(s.conn().total_changes(), before);
}

#[test]
fn one_active_request_per_pod_and_kind() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let req = |kind| NewRequest {
        kind,
        pod_uid: "uid-1",
        namespace: "vehicle",
        name: "telemetry-sv74m",
        from_hash: Some("old"),
        to_hash: "new",
    };
    let Recorded::New(first) = s.record_request(&req(RequestKind::Upgrade)).unwrap() else {
        panic!("first request is new")
    };
    assert_eq!(first.state, "Requested");
    assert!(!first.is_terminal());
    assert_eq!(
        s.record_request(&req(RequestKind::Upgrade)).unwrap(),
        Recorded::Active(first.clone())
    );
    // A different kind for the same pod is independent.
    assert!(matches!(
        s.record_request(&req(RequestKind::ImagePull)).unwrap(),
        Recorded::New(_)
    ));
    assert_eq!(s.active_requests().unwrap().len(), 2);
    // Once terminal, a new upgrade may start.
    s.set_request_state(first.id, "Done", None).unwrap();
    let Recorded::New(second) = s.record_request(&req(RequestKind::Upgrade)).unwrap() else {
        panic!("after Done a new request is allowed")
    };
    assert!(second.id > first.id);
    let latest = s
        .latest_request(RequestKind::Upgrade, "vehicle", "telemetry-sv74m")
        .unwrap()
        .unwrap();
    assert_eq!(latest.id, second.id);
    assert_eq!(
        s.latest_request(RequestKind::Upgrade, "vehicle", "nope")
            .unwrap(),
        None
    );
    // The unique index backs the check even for a writer that skips it.
    let err = s
        .conn()
        .execute(
            "INSERT INTO requests (kind, pod_uid, namespace, name, to_hash, state, created_ms, updated_ms)
             VALUES ('upgrade', 'uid-1', 'vehicle', 'x', 'h', 'Requested', 0, 0)",
            [],
        )
        .unwrap_err();
    assert!(err.to_string().contains("UNIQUE"), "{err}");
}

#[test]
fn request_ids_are_unique_across_databases_and_old_rows_keep_their_labels() {
    let req = NewRequest {
        kind: RequestKind::Upgrade,
        pod_uid: "uid-1",
        namespace: "vehicle",
        name: "telemetry-sv74m",
        from_hash: Some("old"),
        to_hash: "new",
    };
    let mut seen = std::collections::HashSet::new();
    for _ in 0..3 {
        // A new database each time: the rowid restarts at 1, the uid does not repeat.
        let (_d, path) = db();
        let s = Store::open(&path, OpenMode::Normal).unwrap();
        let Recorded::New(r) = s.record_request(&req).unwrap() else {
            panic!("new")
        };
        assert_eq!(r.id, 1);
        assert_eq!(r.uid.len(), 32, "{}", r.uid);
        assert!(seen.insert(r.uid.clone()), "{} repeated", r.uid);
    }
    // A row from before the uid existed keeps its rowid as uid: its containers carry that.
    let (_d, path) = db();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    {
        let s = Store::open(&path, OpenMode::Normal).unwrap();
        let c = s.conn();
        c.execute_batch(
            "DROP INDEX requests_by_uid;
             ALTER TABLE requests DROP COLUMN uid;
             ALTER TABLE requests DROP COLUMN clock_boot;
             ALTER TABLE requests DROP COLUMN waiting;
             INSERT INTO requests (kind, pod_uid, namespace, name, to_hash, state, created_ms,
                 updated_ms, deadline_ms)
             VALUES ('upgrade', 'uid-1', 'vehicle', 'x', 'h', 'Swapping', 0, 0, 123);
             PRAGMA user_version = 9;",
        )
        .unwrap();
    }
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let r = s.request(1).unwrap().unwrap();
    assert_eq!(r.uid, "1");
    // Its deadline was wall-clock time: unknown on the boot clock, so it starts afresh.
    assert_eq!(r.deadline(), None);
    assert!(r.deadline_from_another_boot());
}

#[test]
fn finished_requests_are_kept_per_pod_up_to_a_bound_and_a_repeated_prepull_reuses_its_row() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let req = |kind, to: &'static str| NewRequest {
        kind,
        pod_uid: "uid-1",
        namespace: "vehicle",
        name: "telemetry-sv74m",
        from_hash: Some("old"),
        to_hash: to,
    };
    let rows = |s: &Store| -> i64 {
        s.conn()
            .query_row("SELECT count(*) FROM requests", [], |r| r.get(0))
            .unwrap()
    };
    let logs = |s: &Store| -> i64 {
        s.conn()
            .query_row("SELECT count(*) FROM request_log", [], |r| r.get(0))
            .unwrap()
    };
    for i in 0..20 {
        let Recorded::New(r) = s
            .record_request(&req(
                RequestKind::Upgrade,
                if i % 2 == 0 { "a" } else { "b" },
            ))
            .unwrap()
        else {
            panic!("new")
        };
        assert!(s
            .transition(
                r.id,
                "Requested",
                "RolledBack",
                Some("x"),
                None,
                &Effects::default()
            )
            .unwrap());
    }
    assert_eq!(
        rows(&s),
        HISTORY_PER_POD,
        "only the newest upgrades are kept"
    );
    assert_eq!(logs(&s), HISTORY_PER_POD, "and their logs");
    let newest = s
        .latest_request(RequestKind::Upgrade, "vehicle", "telemetry-sv74m")
        .unwrap()
        .unwrap();
    assert_eq!(newest.id, 20);
    // Asked 300 times for the same target, a pre-pull has one row.
    for _ in 0..300 {
        let Recorded::New(r) = s.record_request(&req(RequestKind::ImagePull, "b")).unwrap() else {
            panic!("new")
        };
        s.transition(r.id, "Requested", "Done", None, None, &Effects::default())
            .unwrap();
    }
    assert_eq!(rows(&s), HISTORY_PER_POD + 1);
    assert!(s.pull_requested("uid-1", "b").unwrap());
    assert_eq!(
        s.pulled_revisions()
            .unwrap()
            .get("uid-1")
            .map(String::as_str),
        Some("b")
    );
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
fn a_node_heartbeat_writes_nothing_and_a_label_change_does() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let node = |rv: &str, beat: &str, label: &str| {
        let raw = format!(
            r#"{{"metadata":{{"name":"edge-1","namespace":"","uid":"n1","resourceVersion":"{rv}","labels":{{"l":"{label}"}}}},"status":{{"conditions":[{{"type":"Ready","status":"True","lastHeartbeatTime":"{beat}"}}]}}}}"#
        );
        StoredObject::from_raw(Kind::Node, raw).unwrap()
    };
    s.apply(
        Kind::Node,
        &[Change::Upsert(node("1", "t1", "a"))],
        Some(("nodes", "1")),
    )
    .unwrap();
    let beat = s
        .apply(
            Kind::Node,
            &[Change::Upsert(node("2", "t2", "a"))],
            Some(("nodes", "2")),
        )
        .unwrap();
    assert!(!beat.touched(), "{beat:?}");
    // Nothing written: the row and the cursor are where they were.
    assert_eq!(
        s.get(Kind::Node, "", "edge-1").unwrap().unwrap(),
        node("1", "t1", "a")
    );
    assert_eq!(s.cursor("nodes").unwrap().as_deref(), Some("1"));
    let relabel = s
        .apply(
            Kind::Node,
            &[Change::Upsert(node("3", "t3", "b"))],
            Some(("nodes", "3")),
        )
        .unwrap();
    assert!(relabel.touched());
    assert_eq!(
        s.get(Kind::Node, "", "edge-1").unwrap().unwrap(),
        node("3", "t3", "b")
    );
}

#[test]
fn parked_cursors_ride_along_with_the_next_commit_or_wait_for_the_interval() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let on_disk = |key: &str| objects::cursor(&s.conn(), key).unwrap();
    let hour = Duration::from_secs(3600);
    s.park_cursor("ds", "5");
    s.park_cursor("cr", "6");
    assert_eq!(s.checkpoint_cursors(hour, false).unwrap(), 0, "not due yet");
    assert_eq!(on_disk("ds"), None);
    // An object change carries them, and its own cursor.
    s.park_cursor("pods", "7");
    s.apply(
        Kind::Pod,
        &[Change::Upsert(pod("a", "8"))],
        Some(("pods", "8")),
    )
    .unwrap();
    assert_eq!(
        (on_disk("ds"), on_disk("cr"), on_disk("pods")),
        (Some("5".into()), Some("6".into()), Some("8".into()))
    );
    assert_eq!(s.checkpoint_cursors(hour, true).unwrap(), 0, "nothing left");
    // An event that changes nothing writes nothing, parked progress included.
    s.park_cursor("ds", "9");
    s.apply(
        Kind::Pod,
        &[Change::Upsert(pod("a", "8"))],
        Some(("pods", "10")),
    )
    .unwrap();
    assert_eq!(on_disk("ds").as_deref(), Some("5"));
    // A round of tokens carries it.
    s.put_tokens(&[CachedToken {
        pod_uid: "uid-a".into(),
        audience: String::new(),
        expiration_secs: 3607,
        token: "t".into(),
        issued_ms: 1,
        expires_ms: 2,
    }])
    .unwrap();
    assert_eq!(on_disk("ds").as_deref(), Some("9"));
    // A bookmark at the version on disk is no progress; a new one waits for the interval
    // from that last write, or is forced out at shutdown.
    s.park_cursor("ds", "9");
    assert_eq!(s.checkpoint_cursors(Duration::ZERO, false).unwrap(), 0);
    s.park_cursor("ds", "11");
    assert_eq!(s.checkpoint_cursors(hour, false).unwrap(), 0);
    assert_eq!(s.checkpoint_cursors(hour, true).unwrap(), 1);
    assert_eq!(on_disk("ds").as_deref(), Some("11"));
    // A relist's own cursor wins over an older parked one of the same reflector.
    s.park_cursor("pods", "12");
    s.replace_all(Kind::Pod, None, &[pod("a", "13")], ("pods", "13"))
        .unwrap();
    assert_eq!(s.checkpoint_cursors(Duration::ZERO, true).unwrap(), 0);
    assert_eq!(on_disk("pods").as_deref(), Some("13"));
}

#[test]
fn objects_come_a_chunk_at_a_time_in_list_order() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let names = ["a", "b", "c", "d", "e"];
    let pods: Vec<StoredObject> = names.iter().map(|n| pod(n, "1")).collect();
    s.replace_all(Kind::Pod, None, &pods, ("pods", "1"))
        .unwrap();
    for (chunk, sizes) in [
        (2, vec![2, 2, 1]),
        (5, vec![5]),
        (1, vec![1; 5]),
        (0, vec![1; 5]),
    ] {
        let mut seen = Vec::new();
        let mut got = Vec::new();
        s.for_each_chunk(Kind::Pod, chunk, |c| {
            got.push(c.len());
            seen.extend(c.into_iter().map(|o| o.index.name));
        })
        .unwrap();
        assert_eq!(got, sizes, "chunk {chunk}");
        assert_eq!(seen, names, "chunk {chunk}");
    }
    let mut calls = 0;
    s.for_each_chunk(Kind::Node, 2, |_| calls += 1).unwrap();
    assert_eq!(calls, 0, "nothing cached, nothing handed over");
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

#[test]
fn the_adopt_timeout_counts_from_when_the_pod_objects_deletion_was_seen() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let p = pod("a", "1");
    s.apply(Kind::Pod, &[Change::Upsert(p.clone())], None)
        .unwrap();
    let c = s.conn();
    c.execute(
        "INSERT INTO running_revisions (pod_uid, hash, images, committed_ms) VALUES ('uid-a', 'h2', '{}', 1)",
        [],
    )
    .unwrap();
    // Marked at 1000 (the DELETE goes out), its pod object still cached: nothing seen.
    journal::mark_awaiting(&c, "uid-a", 1_000).unwrap();
    assert!(journal::deletions_seen(&c, 2_000).unwrap().is_empty());
    drop(c);
    // The watch tells of the deletion; it is seen at 50_000, long after the mark.
    s.apply(
        Kind::Pod,
        &[Change::Delete {
            namespace: "ns".into(),
            name: "a".into(),
        }],
        None,
    )
    .unwrap();
    assert_eq!(
        s.deletions_seen(50_000).unwrap(),
        HashMap::from([("uid-a".to_string(), 50_000)])
    );
    assert_eq!(
        s.deletions_seen(60_000).unwrap()["uid-a"],
        50_000,
        "the first sighting stays"
    );
    // Adopted: nothing awaits any more.
    s.adopt("uid-a", "uid-b").unwrap();
    assert!(s.deletions_seen(70_000).unwrap().is_empty());
}

#[test]
fn a_daemonset_is_gone_only_from_a_cache_that_has_listed_daemonsets() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let ds = StoredObject::from_raw(
        Kind::DaemonSet,
        r#"{"metadata":{"name":"ds","namespace":"ns","uid":"ds1","resourceVersion":"1"}}"#.into(),
    )
    .unwrap();
    // A cache still filling says nothing.
    assert!(!s.daemonset_gone("ns", "ds1").unwrap());
    s.apply(
        Kind::DaemonSet,
        &[Change::Upsert(ds)],
        Some(("daemonsets.apps", "1")),
    )
    .unwrap();
    assert!(!s.daemonset_gone("ns", "ds1").unwrap());
    s.apply(
        Kind::DaemonSet,
        &[Change::Delete {
            namespace: "ns".into(),
            name: "ds".into(),
        }],
        Some(("daemonsets.apps", "2")),
    )
    .unwrap();
    assert!(s.daemonset_gone("ns", "ds1").unwrap());
    // The all-namespaces list covers every namespace.
    assert!(s.daemonset_gone("other", "ds1").unwrap());
}

#[test]
fn a_replaced_status_costs_four_wal_frames_and_an_unchanged_one_none() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let q = |i: usize, phase: &str| QueuedStatus {
        pod_uid: format!("u{i}"),
        namespace: "ns".into(),
        name: format!("p{i}"),
        status: format!("{{\"phase\":\"{phase}\"}}"),
    };
    for i in 0..20 {
        s.queue_status(&q(i, "Pending")).unwrap();
    }
    let checkpoint = |s: &Store, mode: &str| -> i64 {
        s.conn()
            .query_row(&format!("PRAGMA wal_checkpoint({mode})"), [], |r| r.get(1))
            .unwrap()
    };
    checkpoint(&s, "TRUNCATE");
    assert!(!s.queue_status(&q(3, "Pending")).unwrap());
    assert_eq!(checkpoint(&s, "PASSIVE"), 0, "unchanged: nothing written");
    checkpoint(&s, "TRUNCATE");
    assert!(s.queue_status(&q(3, "Running")).unwrap());
    // Moved to the back of the queue: the row, its two indexes and sqlite_sequence (an
    // update in place was 2).
    assert_eq!(checkpoint(&s, "PASSIVE"), 4);
}

#[test]
fn a_deletion_seen_in_another_boot_is_seen_again_now() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let c = s.conn();
    c.execute(
        "INSERT INTO running_revisions (pod_uid, hash, images, committed_ms, awaiting_since_ms)
         VALUES ('uid-a', 'h2', '{}', 1, 1)",
        [],
    )
    .unwrap();
    assert_eq!(journal::deletions_seen(&c, 5_000).unwrap()["uid-a"], 5_000);
    // The device rebooted: the boot clock starts again, and how long ago is unknown.
    c.execute("UPDATE deletions_seen SET boot = 'another-boot'", [])
        .unwrap();
    assert_eq!(journal::deletions_seen(&c, 300).unwrap()["uid-a"], 300);
    assert_eq!(journal::deletions_seen(&c, 900).unwrap()["uid-a"], 300);
}
