use super::*;
use crate::store::{RequestKind, RequestRecord};

fn member(id: i64, name: &str, state: &str) -> RequestRecord {
    RequestRecord {
        id,
        uid: format!("u{id}"),
        kind: RequestKind::Upgrade,
        pod_uid: format!("p{id}"),
        namespace: "vehicle".into(),
        name: name.into(),
        from_hash: Some("a".into()),
        to_hash: "b".into(),
        state: state.into(),
        error: None,
        created_ms: 0,
        updated_ms: 0,
        deadline_ms: None,
        ready_since_ms: None,
        plan: None,
        clock_boot: None,
        waiting: None,
    }
}

fn txn(decision: Option<Decision>, members: Vec<RequestRecord>) -> TxnRecord {
    TxnRecord {
        id: "00000000000000aa".into(),
        decision,
        reason: decision
            .filter(|d| *d == Decision::Rollback)
            .map(|_| "not needed".into()),
        commit_timeout_ms: 1_800_000,
        elapsed_ms: 0,
        clock_boot: None,
        clock_ms: None,
        created_ms: 0,
        updated_ms: 0,
        members,
    }
}

#[test]
fn the_state_follows_the_decision_and_the_members() {
    use TxnState::*;
    let c = Some(Decision::Commit);
    let r = Some(Decision::Rollback);
    let cases: &[(Option<Decision>, &[&str], TxnState)] = &[
        (None, &["Requested", "Requested"], Installing),
        (None, &["Verified", "Pulling"], Installing),
        (None, &["Verified", "Verified"], Verified),
        (None, &["Verified", "Swapping"], Installing),
        (None, &[], Installing),
        (None, &["Verified", "RolledBack"], RollingBack),
        (c, &["Verified", "Committed"], Committing),
        (c, &["Done", "Committed"], Committing),
        (c, &["Done", "Done"], Committed),
        (r, &["Verified", "RollingBack"], RollingBack),
        (r, &["RolledBack", "RollingBack"], RollingBack),
        (r, &["RolledBack", "RolledBack"], RolledBack),
        (r, &["RolledBack", "Failed"], Failed),
        (r, &["Failed", "RollingBack"], RollingBack),
        (None, &["Failed"], Failed),
    ];
    for (d, states, want) in cases {
        assert_eq!(state_of(*d, states), *want, "{d:?} {states:?}");
    }
    for s in [Committed, RolledBack, Failed] {
        assert!(s.is_final());
    }
    for s in [Installing, Verified, Committing, RollingBack] {
        assert!(!s.is_final());
    }
}

#[test]
fn members_install_one_after_another() {
    let t = txn(
        None,
        vec![
            member(1, "a", "Swapping"),
            member(2, "b", "Requested"),
            member(3, "c", "Requested"),
        ],
    );
    assert_eq!(
        gate(&t, 1),
        Gate {
            turn: true,
            verdict: None,
            after: None
        }
    );
    let g = gate(&t, 2);
    assert!(!g.turn);
    assert_eq!(g.after.as_deref(), Some("vehicle/a"));
    assert_eq!(gate(&t, 3).after.as_deref(), Some("vehicle/a"));
    let t = txn(
        None,
        vec![
            member(1, "a", "Verified"),
            member(2, "b", "Pulling"),
            member(3, "c", "Requested"),
        ],
    );
    assert!(gate(&t, 2).turn);
    assert_eq!(gate(&t, 3).after.as_deref(), Some("vehicle/b"));
}

#[test]
fn a_decision_reaches_every_member() {
    let t = txn(
        Some(Decision::Rollback),
        vec![member(1, "a", "Verified"), member(2, "b", "Requested")],
    );
    assert_eq!(
        gate(&t, 2).verdict,
        Some(Verdict::Rollback("not needed".into()))
    );
    let mut t = t;
    t.reason = None;
    assert_eq!(
        gate(&t, 1).verdict,
        Some(Verdict::Rollback("rolled back by the OTA manager".into()))
    );
    let t = txn(Some(Decision::Commit), vec![member(1, "a", "Verified")]);
    assert_eq!(gate(&t, 1).verdict, Some(Verdict::Commit));
}

#[test]
fn durations_read_and_said_back() {
    for (s, secs) in [
        ("90s", 90),
        ("30m", 1800),
        ("2h", 7200),
        ("1h30m", 5400),
        ("1800", 1800),
        ("0", 0),
        ("1m1s", 61),
    ] {
        assert_eq!(parse_duration(s), Ok(Duration::from_secs(secs)), "{s}");
    }
    for bad in [
        "",
        "m",
        "1.5h",
        "-1s",
        "30x",
        "99999999999999999999s",
        "1h 2m",
        "5d",
    ] {
        assert!(parse_duration(bad).is_err(), "{bad}");
    }
    assert!(parse_duration(&"9".repeat(40)).is_err());
    assert_eq!(human(1_800_000), "30m");
    assert_eq!(human(90_000), "1m30s");
    assert_eq!(human(3_600_000), "1h");
    assert_eq!(human(500), "0s");
    assert_eq!(human(-5), "0s");
    assert_eq!(deadline_reason(5_000), "not committed within 5s");
}

#[test]
fn the_deadline_counts_time_verified_across_reboots() {
    let timeout = 1_800_000;
    let every = checkpoint_ms(timeout);
    assert_eq!(every, 60_000);
    assert_eq!(checkpoint_ms(5_000), 1_000, "at least a second");
    assert_eq!(checkpoint_ms(600_000), 20_000);
    // Not Verified yet: nothing counts, nothing is written.
    let stopped = Clock {
        elapsed_ms: 0,
        since: None,
    };
    assert_eq!(stopped.tick(false, "b1", 100, timeout), (0, None));
    // Verified: the count starts here.
    let (live, w) = stopped.tick(true, "b1", 100, timeout);
    assert_eq!(live, 0);
    let w = w.unwrap();
    assert_eq!(w.since, Some(("b1".into(), 100)));
    let c = Clock {
        elapsed_ms: w.elapsed_ms,
        since: w.since,
    };
    // Counting: written only every checkpoint.
    assert_eq!(
        c.tick(true, "b1", 100 + every - 1, timeout),
        (every - 1, None)
    );
    let (live, w) = c.tick(true, "b1", 100 + every, timeout);
    assert_eq!(live, every);
    assert_eq!(
        w,
        Some(ClockWrite {
            elapsed_ms: every,
            since: Some(("b1".into(), 100 + every))
        })
    );
    // A reboot: the boot clock restarts at 5 s; the count carries on from what was written
    // (the time since the last write before the power cut, and while off, is lost).
    let c = Clock {
        elapsed_ms: every,
        since: Some(("b1".into(), 100 + every)),
    };
    let (live, w) = c.tick(true, "b2", 5_000, timeout);
    assert_eq!(live, every, "nothing counted from another boot's clock");
    assert_eq!(w.unwrap().since, Some(("b2".into(), 5_000)));
    let c = Clock {
        elapsed_ms: every,
        since: Some(("b2".into(), 5_000)),
    };
    assert_eq!(c.live("b2", 8_000), every + 3_000);
    // Leaving Verified (the pod is started again after the reboot): the count stops, kept.
    let (live, w) = c.tick(false, "b2", 8_000, timeout);
    assert_eq!(live, every + 3_000);
    assert_eq!(
        w,
        Some(ClockWrite {
            elapsed_ms: every + 3_000,
            since: None
        })
    );
    // A clock that reads earlier than the point (cannot happen in one boot) counts nothing.
    assert_eq!(c.live("b2", 1_000), every);
}
