//! Transactions: grouped requests, one decision, and the rules kept in one write.

use super::*;
use crate::store::transactions::*;

fn req<'a>(uid: &'a str, name: &'a str) -> NewRequest<'a> {
    NewRequest {
        kind: RequestKind::Upgrade,
        pod_uid: uid,
        namespace: "vehicle",
        name,
        from_hash: Some("old"),
        to_hash: "new",
    }
}

fn two(s: &Store) -> TxnRecord {
    match s
        .create_transaction(
            "00000000000000aa",
            60_000,
            &[req("uid-a", "a"), req("uid-b", "b")],
        )
        .unwrap()
    {
        TxnCreated::New(t) => t,
        other => panic!("{other:?}"),
    }
}

fn go(s: &Store, id: i64, from: &str, to: &str, fx: Effects) -> bool {
    s.transition(id, from, to, Some("why"), None, &fx).unwrap()
}

#[test]
fn a_transaction_records_all_its_pods_in_order_or_none() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let t = two(&s);
    assert_eq!(t.decision, None);
    assert_eq!(t.commit_timeout_ms, 60_000);
    let names: Vec<&str> = t.members.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert!(t.members.iter().all(|m| m.state == "Requested"));
    assert_eq!(s.transaction_of(t.members[1].id).unwrap().unwrap().id, t.id);
    // Pod b is busy: a second transaction naming c and b writes nothing, not even c.
    let before = s.active_requests().unwrap().len();
    let r = s
        .create_transaction(
            "00000000000000bb",
            1,
            &[req("uid-c", "c"), req("uid-b", "b")],
        )
        .unwrap();
    assert!(matches!(r, TxnCreated::Active(a) if a.name == "b"));
    assert_eq!(s.active_requests().unwrap().len(), before);
    assert_eq!(s.transaction("00000000000000bb").unwrap(), None);
    assert_eq!(s.transactions(10).unwrap().len(), 1);
}

#[test]
fn commit_needs_every_pod_verified_and_a_committed_pod_never_rolls_back() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let t = two(&s);
    let (a, b) = (t.members[0].id, t.members[1].id);
    for id in [a, b] {
        assert!(go(&s, id, "Requested", "Verified", Effects::default()));
    }
    // One pod leaves Verified first (its new container exited): the commit is refused.
    s.set_request_state(b, "RollingBack", None).unwrap();
    assert!(matches!(
        s.decide_transaction(&t.id, Decision::Commit, None).unwrap(),
        Decided::Refused(_)
    ));
    s.set_request_state(b, "Verified", None).unwrap();
    let Decided::Now(c) = s.decide_transaction(&t.id, Decision::Commit, None).unwrap() else {
        panic!("committed")
    };
    assert_eq!(c.decision, Some(Decision::Commit));
    // Asked again: already; a rollback now: refused.
    assert!(matches!(
        s.decide_transaction(&t.id, Decision::Commit, None).unwrap(),
        Decided::Already(_)
    ));
    assert!(matches!(
        s.decide_transaction(&t.id, Decision::Rollback, Some("no"))
            .unwrap(),
        Decided::Refused(_)
    ));
    // An engine that read the state before the commit cannot roll a member back after it.
    assert!(!go(&s, a, "Verified", "RollingBack", Effects::default()));
    assert_eq!(s.request(a).unwrap().unwrap().state, "Verified");
    assert!(go(&s, a, "Verified", "Committed", Effects::default()));
    assert!(matches!(
        s.decide_transaction("ffffffffffffffff", Decision::Commit, None)
            .unwrap(),
        Decided::Unknown
    ));
}

#[test]
fn a_member_that_fails_rolls_the_transaction_back_in_the_same_write() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let t = two(&s);
    let fx = Effects {
        txn_rollback: Some("pod vehicle/a: new container app exited with code 3".into()),
        ..Default::default()
    };
    assert!(go(
        &s,
        t.members[0].id,
        "Requested",
        "RollingBack",
        fx.clone()
    ));
    let now = s.transaction(&t.id).unwrap().unwrap();
    assert_eq!(now.decision, Some(Decision::Rollback));
    assert_eq!(
        now.reason.as_deref(),
        Some("pod vehicle/a: new container app exited with code 3")
    );
    // The first reason stands.
    let later = Effects {
        txn_rollback: Some("another".into()),
        ..Default::default()
    };
    assert!(go(&s, t.members[1].id, "Requested", "RolledBack", later));
    assert_eq!(
        s.transaction(&t.id).unwrap().unwrap().reason,
        now.reason,
        "the first reason stays"
    );
    assert_eq!(
        s.open_transactions().unwrap().len(),
        1,
        "a is still rolling back"
    );
    assert!(go(
        &s,
        t.members[0].id,
        "RollingBack",
        "RolledBack",
        Effects::default()
    ));
    assert!(s.open_transactions().unwrap().is_empty());
}

#[test]
fn the_deadline_count_is_kept_until_a_decision() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    let t = two(&s);
    s.set_transaction_clock(&t.id, 1234, Some("boot-1"), Some(99))
        .unwrap();
    let now = s.transaction(&t.id).unwrap().unwrap();
    assert_eq!(
        (now.elapsed_ms, now.clock_boot.as_deref(), now.clock_ms),
        (1234, Some("boot-1"), Some(99))
    );
    s.decide_transaction(&t.id, Decision::Rollback, Some("x"))
        .unwrap();
    s.set_transaction_clock(&t.id, 9999, None, None).unwrap();
    assert_eq!(s.transaction(&t.id).unwrap().unwrap().elapsed_ms, 1234);
}

#[test]
fn ended_transactions_are_kept_up_to_a_bound() {
    let (_d, path) = db();
    let s = Store::open(&path, OpenMode::Normal).unwrap();
    for i in 0..(TRANSACTIONS_KEPT + 5) {
        let uid = format!("uid-{i}");
        let id = format!("{i:016x}");
        let TxnCreated::New(t) = s.create_transaction(&id, 1, &[req(&uid, "p")]).unwrap() else {
            panic!("new")
        };
        s.decide_transaction(&t.id, Decision::Rollback, None)
            .unwrap();
        assert!(go(
            &s,
            t.members[0].id,
            "Requested",
            "RolledBack",
            Effects::default()
        ));
    }
    let all = s.transactions(1000).unwrap();
    // Pruned when each new one starts: the bound, plus the newest (ended after it started).
    assert_eq!(all.len() as i64, TRANSACTIONS_KEPT + 1);
    assert_eq!(all[0].id, format!("{:016x}", TRANSACTIONS_KEPT + 4));
}
