//! The object cache and its cursors: what a write costs, replace and prune, chunks.

use super::*;

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

/// `GET /pods` asks for the generation on every request: it must not queue behind a write
/// that holds the connection (a commit's fsync), and it moves only once the write is given
/// back.
#[test]
fn the_generation_does_not_wait_for_the_connection_and_moves_when_a_write_is_given_back() {
    let (_d, path) = db();
    let store = std::sync::Arc::new(Store::open(&path, OpenMode::Normal).unwrap());
    let before = store.generation();
    let conn = store.conn();
    conn.execute(
        "INSERT INTO sync_cursors (resource, resource_version) VALUES ('x', '1')",
        [],
    )
    .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let other = store.clone();
    std::thread::spawn(move || {
        let _ = tx.send(other.generation());
    });
    let seen = rx.recv_timeout(Duration::from_secs(10));
    drop(conn);
    assert_eq!(
        seen,
        Ok(before),
        "read while the connection is held, without waiting, and the write not yet shown"
    );
    assert!(
        store.generation() > before,
        "moved once the write was given back"
    );
}
