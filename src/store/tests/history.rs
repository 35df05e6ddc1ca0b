//! Requests, the journal and the runtime map, and what a status report writes.

use super::*;

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
