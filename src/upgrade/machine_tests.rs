use super::*;

fn seen(id: &str, state: Run) -> Option<Seen> {
    Some(Seen {
        id: id.into(),
        state,
        ready: None,
        exit_code: if state == Run::Exited { 1 } else { 0 },
    })
}

fn journal(state: State) -> Journal {
    Journal {
        state,
        deadline_ms: Some(10_000),
        ready_since_ms: None,
        hold: Duration::from_secs(5),
        manual: false,
        verdict: None,
        turn: true,
    }
}

/// A transaction's upgrade in `state`, with its transaction's `verdict`.
fn member(state: State, verdict: Option<Verdict>) -> Journal {
    Journal {
        manual: true,
        verdict,
        ..journal(state)
    }
}

fn observed(pairs: Vec<Pair>) -> Observed {
    Observed {
        missing_images: Vec::new(),
        pairs,
        sandbox_ready: true,
        recreate: None,
        inits: Vec::new(),
        target_unavailable: None,
        old_unavailable: None,
        restore: Vec::new(),
    }
}

fn pod(id: &str, ready: bool) -> Option<Pod> {
    Some(Pod {
        id: id.into(),
        ready,
        running: ready,
    })
}

/// A ready sandbox whose containers were stopped (kept for a rollback).
fn kept(id: &str) -> Option<Pod> {
    Some(Pod {
        id: id.into(),
        ready: true,
        running: false,
    })
}

const NOTHING: StopFirst = StopFirst::Nothing;
const CONTAINERS: StopFirst = StopFirst::Containers;
const SANDBOX: StopFirst = StopFirst::Sandbox;

fn recreate(
    old: Option<Pod>,
    new: Option<Pod>,
    stop_first: StopFirst,
    pairs: Vec<Pair>,
) -> Observed {
    Observed {
        recreate: Some(Sandboxes {
            old,
            new,
            stop_first,
        }),
        ..observed(pairs)
    }
}

fn pair(old: Option<Seen>, new: Option<Seen>) -> Pair {
    Pair {
        name: "app".into(),
        old,
        new,
    }
}

#[test]
fn states_round_trip_and_only_three_are_terminal() {
    for s in State::ALL {
        assert_eq!(State::parse(s.as_str()), Some(s));
    }
    let terminal: Vec<State> = State::ALL.into_iter().filter(|s| s.is_terminal()).collect();
    assert_eq!(terminal, [State::Done, State::RolledBack, State::Failed]);
    assert_eq!(State::parse("Bogus"), None);
}

#[test]
fn pulling_pulls_what_is_missing_then_swaps_or_gives_up_unchanged() {
    let mut o = observed(vec![pair(seen("old", Run::Running), None)]);
    o.missing_images = vec!["img:2".into()];
    assert_eq!(
        next(&journal(State::Pulling), &o, 0),
        Step::Pull(vec!["img:2".into()])
    );
    assert!(matches!(
        next(&journal(State::Pulling), &o, 10_000),
        Step::Go(State::RolledBack, Some(e)) if e.contains("img:2")
    ));
    o.missing_images.clear();
    assert_eq!(
        next(&journal(State::Pulling), &o, 0),
        Step::Go(State::Swapping, None)
    );
}

#[test]
fn swapping_creates_the_new_stops_the_old_starts_the_new_then_verifies() {
    let j = journal(State::Swapping);
    let o = observed(vec![pair(seen("old", Run::Running), None)]);
    assert_eq!(next(&j, &o, 0), Step::CreateNew("app".into()));
    let o = observed(vec![pair(
        seen("old", Run::Running),
        seen("new", Run::Created),
    )]);
    assert_eq!(next(&j, &o, 0), Step::StopOld("old".into()));
    let o = observed(vec![pair(
        seen("old", Run::Exited),
        seen("new", Run::Created),
    )]);
    assert_eq!(next(&j, &o, 0), Step::Start("new".into()));
    let o = observed(vec![pair(
        seen("old", Run::Exited),
        seen("new", Run::Running),
    )]);
    assert_eq!(next(&j, &o, 0), Step::Go(State::Verifying, None));
    // A crash between any two steps decides the same step again from what runs.
    let o = observed(vec![pair(
        seen("old", Run::Exited),
        seen("new", Run::Exited),
    )]);
    assert!(matches!(
        next(&j, &o, 0),
        Step::Go(State::RollingBack, Some(_))
    ));
    let o = observed(vec![pair(
        seen("old", Run::Running),
        seen("new", Run::Created),
    )]);
    assert!(matches!(
        next(&j, &o, 10_000),
        Step::Go(State::RollingBack, Some(_))
    ));
}

#[test]
fn verification_holds_for_min_ready_and_any_crash_or_unreadiness_rolls_back() {
    let mut j = journal(State::Verifying);
    let ready = |r: Option<bool>| {
        let mut n = seen("new", Run::Running);
        n.as_mut().unwrap().ready = r;
        observed(vec![pair(seen("old", Run::Exited), n)])
    };
    assert_eq!(next(&j, &ready(Some(false)), 0), Step::Wait);
    assert_eq!(
        next(&j, &ready(Some(true)), 100),
        Step::MarkReady(Some(100))
    );
    j.ready_since_ms = Some(100);
    assert_eq!(
        next(&j, &ready(None), 3_000),
        Step::Wait,
        "no probe: running counts"
    );
    assert_eq!(next(&j, &ready(Some(false)), 3_000), Step::MarkReady(None));
    assert_eq!(
        next(&j, &ready(Some(true)), 5_100),
        Step::Go(State::Committed, None)
    );
    j.ready_since_ms = None;
    assert!(matches!(
        next(&j, &ready(Some(false)), 10_000),
        Step::Go(State::RollingBack, Some(e)) if e.contains("not ready in time: app")
    ));
    let crashed = observed(vec![pair(
        seen("old", Run::Exited),
        seen("new", Run::Exited),
    )]);
    assert!(matches!(
        next(&j, &crashed, 0),
        Step::Go(State::RollingBack, Some(e)) if e.contains("exited with code 1")
    ));
}

#[test]
fn commit_removes_the_old_containers_then_is_done() {
    let j = journal(State::Committed);
    let o = observed(vec![pair(
        seen("old", Run::Exited),
        seen("new", Run::Running),
    )]);
    assert_eq!(next(&j, &o, 0), Step::RemoveOld("old".into()));
    let o = observed(vec![pair(None, seen("new", Run::Running))]);
    assert_eq!(next(&j, &o, 0), Step::Go(State::Done, None));
}

#[test]
fn rollback_removes_the_new_and_brings_the_old_spec_back() {
    let j = journal(State::RollingBack);
    let o = observed(vec![pair(
        seen("old", Run::Exited),
        seen("new", Run::Running),
    )]);
    assert_eq!(next(&j, &o, 0), Step::StopNew("new".into()));
    let o = observed(vec![pair(
        seen("old", Run::Exited),
        seen("new", Run::Exited),
    )]);
    assert_eq!(next(&j, &o, 0), Step::RemoveNew("new".into()));
    let o = observed(vec![pair(seen("old", Run::Exited), None)]);
    assert_eq!(
        next(&j, &o, 0),
        Step::RestoreOld {
            name: "app".into(),
            replace: Some("old".into())
        }
    );
    let o = observed(vec![pair(None, None)]);
    assert_eq!(
        next(&j, &o, 0),
        Step::RestoreOld {
            name: "app".into(),
            replace: None
        }
    );
    let o = observed(vec![pair(seen("old2", Run::Created), None)]);
    assert_eq!(next(&j, &o, 0), Step::Start("old2".into()));
    let o = observed(vec![pair(seen("old2", Run::Running), None)]);
    assert_eq!(next(&j, &o, 0), Step::Go(State::RolledBack, None));
    assert!(matches!(
        next(&j, &observed(vec![pair(None, None)]), 10_000),
        Step::Go(State::Failed, Some(_))
    ));
}

#[test]
fn the_swap_never_leaves_a_pod_without_a_running_or_startable_container() {
    // Walk every state against every combination the runtime can show, and check that no
    // step removes the last container of a name without one to take its place.
    let runs = [Run::Created, Run::Running, Run::Exited];
    let mut opts: Vec<Option<Seen>> = vec![None];
    for r in runs {
        opts.push(seen("x", r));
    }
    for state in State::ALL {
        for old in &opts {
            for new in &opts {
                let o = observed(vec![pair(
                    old.clone().map(|mut s| {
                        s.id = "old".into();
                        s
                    }),
                    new.clone().map(|mut s| {
                        s.id = "new".into();
                        s
                    }),
                )]);
                let step = next(&journal(state), &o, 0);
                if let Step::RemoveOld(_) = step {
                    assert!(
                        new.is_some(),
                        "{state}: removes the old one with no new one to take its place"
                    );
                }
                if let Step::RemoveNew(_) = step {
                    assert_eq!(state, State::RollingBack);
                }
            }
        }
    }
}

#[test]
fn recreate_starts_the_new_pod_before_stopping_the_old_unless_ports_force_stop_first() {
    let j = journal(State::Swapping);
    // Pod network: new first.
    let o = recreate(pod("old", true), None, NOTHING, vec![pair(None, None)]);
    assert_eq!(next(&j, &o, 0), Step::CreatePod);
    let o = recreate(
        pod("old", true),
        pod("new", true),
        NOTHING,
        vec![pair(None, seen("c", Run::Created))],
    );
    assert_eq!(next(&j, &o, 0), Step::Start("c".into()));
    // Then the old pod's containers stop; its sandbox stays for a rollback.
    let o = recreate(
        pod("old", true),
        pod("new", true),
        NOTHING,
        vec![pair(None, seen("c", Run::Running))],
    );
    assert_eq!(next(&j, &o, 0), Step::StopContainers("old".into()));
    for old in [kept("old"), pod("old", false), None] {
        let o = recreate(
            old,
            pod("new", true),
            NOTHING,
            vec![pair(None, seen("c", Run::Running))],
        );
        assert_eq!(next(&j, &o, 0), Step::Go(State::Verifying, None));
    }
    // Host network: the old containers stop first (they bind the host's ports), the sandbox
    // stays.
    let o = recreate(pod("old", true), None, CONTAINERS, vec![pair(None, None)]);
    assert_eq!(next(&j, &o, 0), Step::StopContainers("old".into()));
    let o = recreate(kept("old"), None, CONTAINERS, vec![pair(None, None)]);
    assert_eq!(next(&j, &o, 0), Step::CreatePod);
    // Host ports on the pod network: the old sandbox itself stops first.
    let o = recreate(pod("old", true), None, SANDBOX, vec![pair(None, None)]);
    assert_eq!(next(&j, &o, 0), Step::StopPod("old".into()));
    let o = recreate(kept("old"), None, SANDBOX, vec![pair(None, None)]);
    assert_eq!(next(&j, &o, 0), Step::StopPod("old".into()));
    let o = recreate(pod("old", false), None, SANDBOX, vec![pair(None, None)]);
    assert_eq!(next(&j, &o, 0), Step::CreatePod);
    let o = recreate(
        pod("old", false),
        pod("new", false),
        SANDBOX,
        vec![pair(None, None)],
    );
    assert_eq!(next(&j, &o, 0), Step::RemovePod("new".into()));
}

#[test]
fn recreate_commits_by_removing_the_old_pod_and_rolls_back_by_removing_the_new() {
    let o = recreate(
        pod("old", false),
        pod("new", true),
        CONTAINERS,
        vec![pair(None, seen("c", Run::Running))],
    );
    assert_eq!(
        next(&journal(State::Committed), &o, 0),
        Step::RemovePod("old".into())
    );
    let o = recreate(
        None,
        pod("new", true),
        CONTAINERS,
        vec![pair(None, seen("c", Run::Running))],
    );
    assert_eq!(
        next(&journal(State::Committed), &o, 0),
        Step::Go(State::Done, None)
    );
    let j = journal(State::RollingBack);
    let o = recreate(
        pod("old", false),
        pod("new", true),
        CONTAINERS,
        vec![pair(None, seen("c", Run::Running))],
    );
    assert_eq!(next(&j, &o, 0), Step::RemovePod("new".into()));
    let o = recreate(pod("old", false), None, CONTAINERS, vec![pair(None, None)]);
    assert_eq!(next(&j, &o, 0), Step::RemovePod("old".into()));
    let o = recreate(pod("old", true), None, NOTHING, vec![pair(None, None)]);
    assert_eq!(next(&j, &o, 0), Step::Go(State::RolledBack, None));
    let o = recreate(None, None, CONTAINERS, vec![pair(None, None)]);
    assert_eq!(next(&j, &o, 0), Step::Go(State::RolledBack, None));
}

#[test]
fn recreate_runs_init_containers_to_success_before_the_app() {
    let j = journal(State::Swapping);
    let mut o = recreate(
        pod("old", false),
        pod("new", true),
        CONTAINERS,
        vec![pair(None, None)],
    );
    o.inits = vec![Pair {
        name: "init".into(),
        old: None,
        new: None,
    }];
    assert_eq!(next(&j, &o, 0), Step::CreateNew("init".into()));
    o.inits[0].new = seen("i", Run::Created);
    assert_eq!(next(&j, &o, 0), Step::Start("i".into()));
    o.inits[0].new = seen("i", Run::Running);
    assert_eq!(next(&j, &o, 0), Step::Wait);
    o.inits[0].new = Some(Seen {
        id: "i".into(),
        state: Run::Exited,
        ready: None,
        exit_code: 0,
    });
    assert_eq!(next(&j, &o, 0), Step::CreateNew("app".into()));
    o.inits[0].new = seen("i", Run::Exited);
    assert!(matches!(next(&j, &o, 0), Step::Go(State::RollingBack, Some(e)) if e.contains("init")));
}

fn init_pair(old: Option<Seen>, new: Option<Seen>) -> Pair {
    Pair {
        name: "prepare".into(),
        old,
        new,
    }
}

fn exited_with(id: &str, code: i32) -> Option<Seen> {
    Some(Seen {
        id: id.into(),
        state: Run::Exited,
        ready: None,
        exit_code: code,
    })
}

#[test]
fn requested_waits_for_missing_inputs_within_its_deadline_then_ends_unchanged() {
    let mut o = observed(vec![pair(seen("old", Run::Running), None)]);
    o.target_unavailable = Some("configmap vehicle/cfg is not cached".into());
    for state in [State::Requested, State::Pulling] {
        assert_eq!(next(&journal(state), &o, 0), Step::Wait, "{state}");
        assert!(matches!(
            next(&journal(state), &o, 10_000),
            Step::Go(State::RolledBack, Some(e)) if e.contains("configmap vehicle/cfg")
        ));
    }
    o.target_unavailable = None;
    assert_eq!(
        next(&journal(State::Requested), &o, 0),
        Step::Go(State::Pulling, None)
    );
}

#[test]
fn inputs_that_vanish_mid_swap_roll_back_and_a_rollback_without_the_old_spec_waits() {
    let mut o = observed(vec![pair(
        seen("old", Run::Exited),
        seen("new", Run::Running),
    )]);
    o.target_unavailable = Some("configmap gone".into());
    assert!(matches!(
        next(&journal(State::Swapping), &o, 0),
        Step::Go(State::RollingBack, Some(e)) if e.contains("configmap gone")
    ));
    // The new container goes first, whatever the inputs.
    assert_eq!(
        next(&journal(State::RollingBack), &o, 0),
        Step::StopNew("new".into())
    );
    o.pairs = vec![pair(seen("old", Run::Exited), None)];
    o.old_unavailable = Some("configmap gone".into());
    assert_eq!(next(&journal(State::RollingBack), &o, 0), Step::Wait);
    assert!(matches!(
        next(&journal(State::RollingBack), &o, 10_000),
        Step::Go(State::Failed, Some(_))
    ));
}

#[test]
fn a_commit_past_its_deadline_is_done_the_rest_is_the_runtimes() {
    let o = observed(vec![pair(
        seen("old", Run::Exited),
        seen("new", Run::Running),
    )]);
    assert_eq!(
        next(&journal(State::Committed), &o, 0),
        Step::RemoveOld("old".into())
    );
    assert_eq!(
        next(&journal(State::Committed), &o, 10_000),
        Step::Go(State::Done, None)
    );
    let r = recreate(pod("old", false), pod("new", true), NOTHING, vec![]);
    assert_eq!(
        next(&journal(State::Committed), &r, 10_000),
        Step::Go(State::Done, None)
    );
}

#[test]
fn in_place_an_init_container_runs_to_completion_before_the_app_is_swapped() {
    let app = || pair(seen("old-app", Run::Running), None);
    let mut o = observed(vec![app()]);
    o.inits = vec![init_pair(exited_with("old-init", 0), None)];
    let j = journal(State::Swapping);
    assert_eq!(next(&j, &o, 0), Step::CreateNew("prepare".into()));
    o.inits[0].new = seen("new-init", Run::Created);
    assert_eq!(next(&j, &o, 0), Step::Start("new-init".into()));
    o.inits[0].new = seen("new-init", Run::Running);
    assert_eq!(next(&j, &o, 0), Step::Wait, "the app waits for the init");
    // Exit 0 is success, as for any init container: on to the app.
    o.inits[0].new = exited_with("new-init", 0);
    assert_eq!(next(&j, &o, 0), Step::CreateNew("app".into()));
    o.pairs = vec![pair(
        seen("old-app", Run::Exited),
        seen("new-app", Run::Running),
    )];
    assert_eq!(next(&j, &o, 0), Step::Go(State::Verifying, None));
    // Verifying looks at the app; the init stays completed.
    let mut v = journal(State::Verifying);
    v.ready_since_ms = Some(0);
    assert_eq!(next(&v, &o, 5_000), Step::Go(State::Committed, None));
    // Commit removes the old init with the old app.
    assert_eq!(
        next(&journal(State::Committed), &o, 0),
        Step::RemoveOld("old-init".into())
    );
    // Any other exit code rolls back.
    o.inits[0].new = exited_with("new-init", 2);
    assert!(matches!(
        next(&j, &o, 0),
        Step::Go(State::RollingBack, Some(e)) if e.contains("init container prepare exited with code 2")
    ));
}

#[test]
fn a_rollback_removes_a_new_init_container_and_never_reruns_the_old_one() {
    let mut o = observed(vec![pair(seen("old-app", Run::Running), None)]);
    o.inits = vec![init_pair(
        exited_with("old-init", 0),
        exited_with("new-init", 2),
    )];
    let j = journal(State::RollingBack);
    assert_eq!(next(&j, &o, 0), Step::RemoveNew("new-init".into()));
    o.inits[0].new = None;
    assert_eq!(next(&j, &o, 0), Step::Go(State::RolledBack, None));
}

#[test]
fn every_open_state_times_out_even_unobserved() {
    for s in State::ALL {
        let step = timed_out(s, "the runtime does not answer");
        match s {
            State::Requested | State::Pulling => assert!(
                matches!(&step, Some(Step::Go(State::RolledBack, Some(e))) if e.contains("does not answer"))
            ),
            State::Swapping | State::Verifying => {
                assert!(matches!(step, Some(Step::Go(State::RollingBack, Some(_)))))
            }
            State::RollingBack => assert!(matches!(step, Some(Step::Go(State::Failed, Some(_))))),
            State::Committed => assert_eq!(step, Some(Step::Go(State::Done, None))),
            // Its transaction's commit deadline decides for it.
            State::Verified => assert_eq!(step, None),
            State::Done | State::RolledBack | State::Failed => assert_eq!(step, None),
        }
        assert!(
            s.is_terminal()
                || s == State::Verified
                || Deadlines::default().of(s, Duration::ZERO).is_some(),
            "{s} has a deadline"
        );
    }
}

#[path = "machine_txn_tests.rs"]
mod txn;
