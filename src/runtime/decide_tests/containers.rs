//! Within a pod: sandboxes and containers started, crash backoff, restart policies, init containers, refusals, probes and volumes.

use super::*;

#[test]
fn a_pod_without_a_sandbox_is_started_and_its_old_sandboxes_go_first() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("old", "uid-a", false, 0));
    w.snap.containers.push(container(
        "c-old",
        "old",
        "uid-a",
        "app",
        api::ContainerState::ContainerExited,
        0,
    ));
    w.add(pod_json("a", &["app"]));
    let acts = w.decide();
    assert_eq!(names(&acts), ["StartPod:uid-a"]);
    let Action::StartPod {
        remove_sandboxes,
        remove_containers,
        spec,
        ..
    } = &acts[0]
    else {
        unreachable!()
    };
    assert_eq!(remove_sandboxes, &["old"]);
    assert_eq!(remove_containers, &["c-old"]);
    assert_eq!(spec.ctx.attempt, 1, "the next sandbox attempt");
}

#[test]
fn a_settled_pod_gets_nothing_and_a_held_pod_is_left_alone() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    w.snap.containers.push(container(
        "c1",
        "sb",
        "uid-a",
        "app",
        api::ContainerState::ContainerRunning,
        0,
    ));
    w.add(pod_json("a", &["app"]));
    assert!(w.decide().is_empty());
    // Held (an upgrade owns it): even a dead container is left to its owner.
    w.snap.containers[0].state = api::ContainerState::ContainerExited as i32;
    w.held.insert("uid-a".into());
    assert!(w.decide().is_empty());
}

#[test]
fn missing_containers_are_created_and_created_ones_started() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    w.snap.containers.push(container(
        "c1",
        "sb",
        "uid-a",
        "one",
        api::ContainerState::ContainerCreated,
        0,
    ));
    w.add(pod_json("a", &["one", "two"]));
    let acts = w.decide();
    assert!(matches!(&acts[0], Action::StartCreated { container_id, .. } if container_id == "c1"));
    assert!(
        matches!(&acts[1], Action::CreateContainer { container, attempt: 0, replace: None, .. } if container.name == "two")
    );
}

#[test]
fn an_exit_waits_its_backoff_then_gets_the_next_attempt() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    w.snap.containers.push(container(
        "c1",
        "sb",
        "uid-a",
        "app",
        api::ContainerState::ContainerExited,
        3,
    ));
    w.add(pod_json("a", &["app"]));
    let acts = w.decide();
    let Action::WaitRestart { restarts, .. } = &acts[0] else {
        panic!("{acts:?}")
    };
    assert_eq!(restarts.count, 1);
    assert_eq!(restarts.next_allowed, Some(w.now + Duration::from_secs(10)));
    w.restarts
        .insert(("uid-a".into(), "app".into()), restarts.clone());
    assert!(w.decide().is_empty(), "still waiting");
    w.now += Duration::from_secs(11);
    let acts = w.decide();
    assert!(
        matches!(&acts[0], Action::CreateContainer { attempt: 4, replace: Some(old), .. } if old == "c1"),
        "{acts:?}"
    );
}

#[test]
fn backoff_grows_with_each_crash_and_resets_after_ten_minutes_of_running() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    w.snap.containers.push(container(
        "c9",
        "sb",
        "uid-a",
        "app",
        api::ContainerState::ContainerExited,
        5,
    ));
    w.add(pod_json("a", &["app"]));
    // Five crashes so far, the last one a different container.
    w.restarts.insert(
        ("uid-a".into(), "app".into()),
        Restarts {
            count: 5,
            next_allowed: Some(w.now),
            exited: Some("c8".into()),
        },
    );
    let short = ContainerFacts {
        exit_code: 1,
        started_at: 1_000_000_000,
        finished_at: 61_000_000_000,
        ..Default::default()
    };
    w.snap.facts.insert("c9".into(), short);
    let Action::WaitRestart { restarts, .. } = &w.decide()[0] else {
        panic!()
    };
    assert_eq!(
        (restarts.count, restarts.next_allowed),
        (6, Some(w.now + Duration::from_secs(300)))
    );
    // The same container ran 10 minutes before it exited: the backoff starts over.
    w.snap.facts.get_mut("c9").unwrap().finished_at = 1_000_000_000 + 601_000_000_000;
    let Action::WaitRestart { restarts, .. } = &w.decide()[0] else {
        panic!()
    };
    assert_eq!(
        (restarts.count, restarts.next_allowed),
        (1, Some(w.now + Duration::from_secs(10)))
    );
}

#[test]
fn restart_policies() {
    for (policy, code, restart) in [
        ("Always", 0, true),
        ("OnFailure", 0, false),
        ("OnFailure", 1, true),
        ("Never", 1, false),
    ] {
        let mut w = World::new();
        w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
        w.snap.containers.push(container(
            "c1",
            "sb",
            "uid-a",
            "app",
            api::ContainerState::ContainerExited,
            0,
        ));
        w.snap.facts.insert(
            "c1".into(),
            ContainerFacts {
                exit_code: code,
                ..Default::default()
            },
        );
        let mut v = pod_json("a", &["app"]);
        v["spec"]["restartPolicy"] = json!(policy);
        w.add(v);
        assert_eq!(
            !w.decide().is_empty(),
            restart,
            "{policy} after exit {code}"
        );
    }
}

#[test]
fn init_containers_run_one_at_a_time_before_the_app() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    let mut v = pod_json("a", &["app"]);
    v["spec"]["initContainers"] =
        json!([{"name": "i1", "image": "img:1"}, {"name": "i2", "image": "img:1"}]);
    w.add(v);
    let acts = w.decide();
    assert_eq!(acts.len(), 1);
    assert!(
        matches!(&acts[0], Action::CreateContainer { container, .. } if container.name == "i1")
    );
    // i1 succeeded: i2 next, still not the app.
    w.snap.containers.push(container(
        "i1",
        "sb",
        "uid-a",
        "i1",
        api::ContainerState::ContainerExited,
        0,
    ));
    w.snap.facts.insert("i1".into(), ContainerFacts::default());
    let acts = w.decide();
    assert!(
        matches!(&acts[0], Action::CreateContainer { container, .. } if container.name == "i2")
    );
    assert_eq!(acts.len(), 1);
}

#[test]
fn a_refused_pod_waits_its_backoff() {
    let mut w = World::new();
    w.add(pod_json("a", &["app"]));
    w.refused.insert(
        "uid-a".into(),
        Restarts {
            count: 1,
            next_allowed: Some(w.now + Duration::from_secs(5)),
            exited: None,
        },
    );
    assert!(w.decide().is_empty(), "no new sandbox during the backoff");
    w.now += Duration::from_secs(6);
    assert_eq!(names(&w.decide()), ["StartPod:uid-a"]);
}

fn probe_spec() -> ProbeSpec {
    ProbeSpec {
        action: ProbeAction::Exec(vec!["true".into()]),
        initial_delay: Duration::ZERO,
        period: Duration::from_secs(5),
        timeout: Duration::from_secs(1),
        success_threshold: 1,
        failure_threshold: 1,
    }
}

#[test]
fn due_probes_run_and_a_failed_liveness_stops_the_container() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    w.snap.containers.push(container(
        "c1",
        "sb",
        "uid-a",
        "app",
        api::ContainerState::ContainerRunning,
        0,
    ));
    w.add(pod_json("a", &["app"]));
    let mut p = ContainerProbes {
        id: "c1".into(),
        liveness: Some((probe_spec(), ProbeState::new(w.now))),
        readiness: None,
    };
    w.probes.insert(("uid-a".into(), "app".into()), p.clone());
    let acts = w.decide();
    assert!(
        matches!(&acts[0], Action::Probe { kind: ProbeKind::Liveness, container_id, .. } if container_id == "c1")
    );
    p.record(ProbeKind::Liveness, w.now, Err("exit 1".into()));
    w.probes.insert(("uid-a".into(), "app".into()), p);
    let acts = w.decide();
    assert!(
        matches!(&acts[0], Action::StopContainer { container_id, grace_secs: 7, why, .. } if container_id == "c1" && why == "exit 1"),
        "{acts:?}"
    );
}

#[test]
fn changed_file_volumes_are_rewritten() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    w.snap.containers.push(container(
        "c1",
        "sb",
        "uid-a",
        "app",
        api::ContainerState::ContainerRunning,
        0,
    ));
    w.add(pod_json("a", &["app"]));
    w.volumes.insert("uid-a".into(), 1);
    assert_eq!(names(&w.decide()), ["RefreshVolumes:uid-a"]);
}
