//! A transaction's upgrade: it stops at Verified, and goes on only as its transaction says.

use super::*;

fn rollback(why: &str) -> Option<Verdict> {
    Some(Verdict::Rollback(why.into()))
}

fn ready(id: &str, r: Option<bool>) -> Option<Seen> {
    let mut s = seen(id, Run::Running);
    s.as_mut().unwrap().ready = r;
    s
}

#[test]
fn a_transactions_upgrade_stops_at_verified_instead_of_committing() {
    let mut j = member(State::Verifying, None);
    j.ready_since_ms = Some(0);
    let o = observed(vec![pair(
        seen("old", Run::Exited),
        ready("new", Some(true)),
    )]);
    assert_eq!(next(&j, &o, 5_000), Step::Go(State::Verified, None));
    j.manual = false;
    assert_eq!(next(&j, &o, 5_000), Step::Go(State::Committed, None));
}

#[test]
fn verified_waits_for_the_decision_and_watches_the_new_containers() {
    let j = member(State::Verified, None);
    let running = observed(vec![pair(
        seen("old", Run::Exited),
        seen("new", Run::Running),
    )]);
    // No deadline of its own: an hour later it still waits.
    assert_eq!(next(&j, &running, 3_600_000), Step::Wait);
    // Readiness is not looked at again once verified (nothing probes it then).
    let unready = observed(vec![pair(
        seen("old", Run::Exited),
        ready("new", Some(false)),
    )]);
    assert_eq!(next(&j, &unready, 0), Step::Wait);
    let crashed = observed(vec![pair(
        seen("old", Run::Exited),
        seen("new", Run::Exited),
    )]);
    assert!(matches!(
        next(&j, &crashed, 0),
        Step::Go(State::RollingBack, Some(e)) if e == "new container app exited with code 1 before the commit"
    ));
    let gone = observed(vec![pair(seen("old", Run::Exited), None)]);
    assert!(matches!(
        next(&j, &gone, 0),
        Step::Go(State::RollingBack, Some(e)) if e.contains("is gone before the commit")
    ));
    // The pod no longer runs (a reboot): its new revision starts again, still uncommitted.
    let mut down = crashed.clone();
    down.sandbox_ready = false;
    assert_eq!(next(&j, &down, 0), Step::Go(State::Swapping, None));
    // Recreate: the new sandbox is what must run (the observer says so in `sandbox_ready`).
    let mut r = recreate(kept("old"), pod("new", false), NOTHING, vec![]);
    r.sandbox_ready = false;
    assert_eq!(next(&j, &r, 0), Step::Go(State::Swapping, None));
    let mut r = recreate(kept("old"), pod("new", true), NOTHING, vec![]);
    r.sandbox_ready = true;
    assert_eq!(next(&j, &r, 0), Step::Wait);
}

#[test]
fn the_decision_is_carried_out_whatever_the_runtime_shows() {
    let crashed = observed(vec![pair(
        seen("old", Run::Exited),
        seen("new", Run::Exited),
    )]);
    let commit = member(State::Verified, Some(Verdict::Commit));
    assert_eq!(decided(&commit), Some(Step::Go(State::Committed, None)));
    assert_eq!(
        next(&commit, &crashed, 0),
        Step::Go(State::Committed, None),
        "the manager was told it committed: it does"
    );
    let back = member(State::Verified, rollback("the root filesystem failed"));
    assert_eq!(
        next(&back, &crashed, 0),
        Step::Go(
            State::RollingBack,
            Some("the root filesystem failed".into())
        )
    );
    // Nothing changed yet: it ends at once, with the reason.
    for s in [State::Requested, State::Pulling] {
        assert_eq!(
            decided(&member(s, rollback("abort"))),
            Some(Step::Go(State::RolledBack, Some("abort".into())))
        );
    }
    for s in [State::Swapping, State::Verifying] {
        assert_eq!(
            decided(&member(s, rollback("abort"))),
            Some(Step::Go(State::RollingBack, Some("abort".into())))
        );
    }
}

#[test]
fn a_member_waits_for_its_turn_before_anything() {
    let mut j = member(State::Requested, None);
    j.turn = false;
    let o = observed(vec![pair(seen("old", Run::Running), None)]);
    assert_eq!(next(&j, &o, 20_000), Step::Wait, "even past the deadline");
    j.turn = true;
    assert_eq!(next(&j, &o, 0), Step::Go(State::Pulling, None));
    j.turn = false;
    j.verdict = rollback("another pod failed");
    assert!(matches!(
        next(&j, &o, 0),
        Step::Go(State::RolledBack, Some(_))
    ));
}

/// Walks every state, verdict and runtime view: a transaction's upgrade commits only on the
/// commit, a committed one never rolls back, and every verdict is final.
#[test]
fn only_the_commit_commits_and_nothing_undoes_it() {
    let runs = [Run::Created, Run::Running, Run::Exited, Run::Unknown];
    let mut opts: Vec<Option<Seen>> = vec![None];
    for r in runs {
        for ready in [None, Some(true), Some(false)] {
            let mut s = seen("x", r);
            s.as_mut().unwrap().ready = ready;
            opts.push(s);
        }
    }
    let verdicts = [None, Some(Verdict::Commit), rollback("r")];
    for state in State::ALL {
        for verdict in &verdicts {
            for turn in [true, false] {
                for since in [None, Some(0)] {
                    for sandbox_ready in [true, false] {
                        for old in &opts {
                            for new in &opts {
                                let mut j = member(state, verdict.clone());
                                j.turn = turn;
                                j.ready_since_ms = since;
                                let mut o = observed(vec![pair(old.clone(), new.clone())]);
                                o.sandbox_ready = sandbox_ready;
                                for now in [0, 20_000] {
                                    let step = next(&j, &o, now);
                                    check(&j, &step);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn check(j: &Journal, step: &Step) {
    let ctx = format!("{:?} {:?} -> {step:?}", j.state, j.verdict);
    if let Step::Go(State::Committed, _) = step {
        assert_eq!(j.verdict, Some(Verdict::Commit), "{ctx}");
        assert_eq!(j.state, State::Verified, "{ctx}");
    }
    if j.verdict == Some(Verdict::Commit) && j.state == State::Verified {
        assert_eq!(step, &Step::Go(State::Committed, None), "{ctx}");
    }
    if let Some(Verdict::Rollback(_)) = &j.verdict {
        if matches!(
            j.state,
            State::Requested
                | State::Pulling
                | State::Swapping
                | State::Verifying
                | State::Verified
        ) {
            assert!(
                matches!(step, Step::Go(State::RollingBack | State::RolledBack, Some(r)) if r == "r"),
                "{ctx}"
            );
        }
    }
    if j.state == State::Requested && !j.turn && j.verdict.is_none() {
        assert_eq!(step, &Step::Wait, "{ctx}");
    }
    if let Step::Go(State::RollingBack | State::RolledBack | State::Failed, why) = step {
        assert!(
            why.is_some() || j.state == State::RollingBack,
            "{ctx}: a reason"
        );
    }
}

#[test]
fn a_rollback_ends_once_the_old_revision_is_ready_again() {
    let j = journal(State::RollingBack);
    let o = observed(vec![pair(ready("old2", Some(false)), None)]);
    assert_eq!(next(&j, &o, 0), Step::Wait);
    assert!(matches!(
        next(&j, &o, 10_000),
        Step::Go(State::Failed, Some(e)) if e == "the old revision runs again but is not ready in time: app"
    ));
    let o = observed(vec![pair(ready("old2", Some(true)), None)]);
    assert_eq!(next(&j, &o, 0), Step::Go(State::RolledBack, None));
    let o = observed(vec![pair(ready("old2", None), None)]);
    assert_eq!(
        next(&j, &o, 0),
        Step::Go(State::RolledBack, None),
        "no probe"
    );
}

#[test]
fn a_recreate_rolls_back_into_the_kept_sandbox_and_verifies_it() {
    let j = journal(State::RollingBack);
    let with = |old: Option<Pod>, new: Option<Pod>, was: Option<Seen>| {
        let mut o = recreate(old, new, CONTAINERS, vec![]);
        o.restore = vec![pair(was, None)];
        o
    };
    let stopped = seen("old-app", Run::Exited);
    assert_eq!(
        next(&j, &with(kept("old"), pod("new", true), stopped.clone()), 0),
        Step::RemovePod("new".into())
    );
    assert_eq!(
        next(&j, &with(kept("old"), None, stopped.clone()), 0),
        Step::RestoreOld {
            name: "app".into(),
            replace: Some("old-app".into())
        }
    );
    assert_eq!(
        next(&j, &with(kept("old"), None, seen("r", Run::Created)), 0),
        Step::Start("r".into())
    );
    assert_eq!(
        next(&j, &with(kept("old"), None, ready("r", Some(false))), 0),
        Step::Wait
    );
    assert_eq!(
        next(&j, &with(kept("old"), None, ready("r", Some(true))), 0),
        Step::Go(State::RolledBack, None)
    );
    assert!(matches!(
        next(&j, &with(kept("old"), None, ready("r", Some(false))), 10_000),
        Step::Go(State::Failed, Some(e)) if e.contains("not ready in time: app")
    ));
    // Old inputs gone: it waits for them, within the deadline.
    let mut o = with(kept("old"), None, stopped.clone());
    o.old_unavailable = Some("configmap gone".into());
    assert_eq!(next(&j, &o, 0), Step::Wait);
    // A stopped old sandbox cannot run again: it goes, and the runtime starts the pod afresh.
    assert_eq!(
        next(&j, &with(pod("old", false), None, stopped), 0),
        Step::RemovePod("old".into())
    );
    assert_eq!(
        next(&j, &with(None, None, None), 0),
        Step::Go(State::RolledBack, None)
    );
}
