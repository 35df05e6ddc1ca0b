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
    }
}

fn observed(pairs: Vec<Pair>) -> Observed {
    Observed {
        missing_images: Vec::new(),
        pairs,
        sandbox_ready: true,
        recreate: None,
        inits: Vec::new(),
    }
}

fn pod(id: &str, ready: bool) -> Option<Pod> {
    Some(Pod {
        id: id.into(),
        ready,
    })
}

fn recreate(old: Option<Pod>, new: Option<Pod>, stop_first: bool, pairs: Vec<Pair>) -> Observed {
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
    let o = recreate(pod("old", true), None, false, vec![pair(None, None)]);
    assert_eq!(next(&j, &o, 0), Step::CreatePod);
    let o = recreate(
        pod("old", true),
        pod("new", true),
        false,
        vec![pair(None, seen("c", Run::Created))],
    );
    assert_eq!(next(&j, &o, 0), Step::Start("c".into()));
    let o = recreate(
        pod("old", true),
        pod("new", true),
        false,
        vec![pair(None, seen("c", Run::Running))],
    );
    assert_eq!(next(&j, &o, 0), Step::StopPod("old".into()));
    let o = recreate(
        pod("old", false),
        pod("new", true),
        false,
        vec![pair(None, seen("c", Run::Running))],
    );
    assert_eq!(next(&j, &o, 0), Step::Go(State::Verifying, None));
    // Host network: the old one stops first.
    let o = recreate(pod("old", true), None, true, vec![pair(None, None)]);
    assert_eq!(next(&j, &o, 0), Step::StopPod("old".into()));
    let o = recreate(pod("old", false), None, true, vec![pair(None, None)]);
    assert_eq!(next(&j, &o, 0), Step::CreatePod);
    let o = recreate(
        pod("old", false),
        pod("new", false),
        true,
        vec![pair(None, None)],
    );
    assert_eq!(next(&j, &o, 0), Step::RemovePod("new".into()));
}

#[test]
fn recreate_commits_by_removing_the_old_pod_and_rolls_back_by_removing_the_new() {
    let o = recreate(
        pod("old", false),
        pod("new", true),
        true,
        vec![pair(None, seen("c", Run::Running))],
    );
    assert_eq!(
        next(&journal(State::Committed), &o, 0),
        Step::RemovePod("old".into())
    );
    let o = recreate(
        None,
        pod("new", true),
        true,
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
        true,
        vec![pair(None, seen("c", Run::Running))],
    );
    assert_eq!(next(&j, &o, 0), Step::RemovePod("new".into()));
    let o = recreate(pod("old", false), None, true, vec![pair(None, None)]);
    assert_eq!(next(&j, &o, 0), Step::RemovePod("old".into()));
    let o = recreate(pod("old", true), None, false, vec![pair(None, None)]);
    assert_eq!(next(&j, &o, 0), Step::Go(State::RolledBack, None));
    let o = recreate(None, None, true, vec![pair(None, None)]);
    assert_eq!(next(&j, &o, 0), Step::Go(State::RolledBack, None));
}

#[test]
fn recreate_runs_init_containers_to_success_before_the_app() {
    let j = journal(State::Swapping);
    let mut o = recreate(
        pod("old", false),
        pod("new", true),
        true,
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
