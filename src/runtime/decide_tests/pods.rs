//! Across pods: an empty cache, adoption, deletion, unreadable pods, what a failed upgrade left, sandboxes of another revision.

use super::*;

#[test]
fn an_empty_cache_stops_nothing_until_the_pod_list_has_completed() {
    let mut w = World::new();
    w.ready = false;
    w.snap.sandboxes.push(sandbox("sb", "uid-x", true, 0));
    w.snap.containers.push(container(
        "c1",
        "sb",
        "uid-x",
        "app",
        api::ContainerState::ContainerRunning,
        0,
    ));
    w.snap.pod_dirs.insert("uid-x".into());
    assert!(w.decide().is_empty(), "nothing is stopped, nothing deleted");
    // The list completed and did not have it: it goes, with its pod's grace period.
    w.ready = true;
    let acts = w.decide();
    assert!(
        matches!(&acts[0], Action::KillPod { sandboxes, containers, grace_secs: 9, .. }
            if sandboxes == &["sb"] && containers == &["c1"]),
        "{acts:?}"
    );
    // Once the sandbox is gone, its directory (Secrets, tokens) goes too.
    w.snap.sandboxes.clear();
    w.snap.containers.clear();
    assert_eq!(names(&w.decide()), ["RemovePodDir:uid-x"]);
}

#[test]
fn a_pod_the_list_confirms_is_adopted_as_it_runs() {
    let mut w = World::new();
    w.ready = true;
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
    assert!(w.decide().is_empty(), "no restart, no removal");
}

#[test]
fn a_deleted_pod_is_stopped_with_its_grace_then_finalized() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    let mut v = pod_json("a", &["app"]);
    v["metadata"]["deletionTimestamp"] = json!("2026-11-30T00:00:00Z");
    v["metadata"]["deletionGracePeriodSeconds"] = json!(3);
    w.add(v);
    // Even before the first list: the cache says this pod is being deleted.
    w.ready = false;
    let acts = w.decide();
    assert!(
        matches!(&acts[0], Action::KillPod { grace_secs: 3, .. }),
        "{acts:?}"
    );
    w.snap.sandboxes.clear();
    assert_eq!(names(&w.decide()), ["Finalize:uid-a"]);
}

#[test]
fn an_unreadable_pod_is_left_running_and_a_blocked_one_says_why() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    let mut d = desired(pod_json("a", &["app"]), &w.snap);
    d.plan = None;
    w.desired.push(d);
    assert!(w.decide().is_empty());

    let mut d = desired(pod_json("b", &["app"]), &w.snap);
    d.plan = Some(Err(PlanError::Missing(Missing {
        reason: "ConfigMapUnavailable",
        message: "configmap \"ns/c\" not cached yet".into(),
        known_absent: false,
    })));
    w.desired.push(d);
    let acts = w.decide();
    assert!(
        matches!(
            &acts[0],
            Action::Blocked {
                reason: "ConfigMapUnavailable",
                warn: false,
                ..
            }
        ),
        "{acts:?}"
    );
}

#[test]
fn what_an_upgrade_that_did_not_commit_left_goes_before_anything_else() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    // The old app was stopped by the swap; the failed upgrade's new one runs.
    w.snap.containers.push(container(
        "old",
        "sb",
        "uid-a",
        "app",
        api::ContainerState::ContainerExited,
        0,
    ));
    let mut new = container(
        "new",
        "sb",
        "uid-a",
        "app",
        api::ContainerState::ContainerRunning,
        1,
    );
    new.labels
        .insert(labels::UPGRADE_ID.to_string(), "u-failed".to_string());
    w.snap.containers.push(new);
    w.add(pod_json("a", &["app"]));
    // An upgrade that committed: its container is the pod's.
    assert!(!names(&w.decide()).contains(&"RemoveLeftovers:uid-a".to_string()));
    w.ended.insert("u-failed".into());
    let acts = w.decide();
    assert_eq!(names(&acts), ["RemoveLeftovers:uid-a"], "alone, first");
    let Action::RemoveLeftovers {
        sandboxes,
        containers,
        grace_secs,
        ..
    } = &acts[0]
    else {
        unreachable!()
    };
    assert!(sandboxes.is_empty());
    assert_eq!(containers, &["new"]);
    assert_eq!(*grace_secs, 7);
    // Once it is gone, the old spec's container comes back as after any exit.
    w.snap.containers.pop();
    assert!(!names(&w.decide()).contains(&"RemoveLeftovers:uid-a".to_string()));
    // Held by its upgrade, nothing of it is touched.
    w.held.insert("uid-a".into());
    assert!(w.decide().is_empty());
}

#[test]
fn of_two_ready_sandboxes_the_older_goes_unless_the_newer_is_a_failed_upgrades() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("old", "uid-a", true, 0));
    w.snap.sandboxes.push(sandbox("new", "uid-a", true, 1));
    for (id, sb) in [("c-old", "old"), ("c-new", "new")] {
        w.snap.containers.push(container(
            id,
            sb,
            "uid-a",
            "app",
            api::ContainerState::ContainerRunning,
            0,
        ));
    }
    w.add(pod_json("a", &["app"]));
    let acts = w.decide();
    let Action::RemoveLeftovers {
        sandboxes,
        containers,
        ..
    } = &acts[0]
    else {
        panic!("{acts:?}")
    };
    assert_eq!(
        (sandboxes.as_slice(), containers.as_slice()),
        (&["old".to_string()][..], &["c-old".to_string()][..])
    );
    // The newer one is a failed recreate's: it goes, the older one stays.
    w.snap.sandboxes[1]
        .labels
        .insert(labels::UPGRADE_ID.to_string(), "u-failed".to_string());
    w.ended.insert("u-failed".into());
    let acts = w.decide();
    let Action::RemoveLeftovers {
        sandboxes,
        containers,
        ..
    } = &acts[0]
    else {
        panic!("{acts:?}")
    };
    assert_eq!(
        (sandboxes.as_slice(), containers.as_slice()),
        (&["new".to_string()][..], &["c-new".to_string()][..])
    );
}

/// A replacement pod of the awaiting sandbox's DaemonSet, at revision `hash`.
fn replacement(hash: &str) -> serde_json::Value {
    let mut v = pod_json("b", &["app"]);
    v["metadata"]["labels"] = json!({"controller-revision-hash": hash});
    v["metadata"]["ownerReferences"] = json!([{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "ds1", "controller": true}]);
    v
}

#[test]
fn a_replacement_at_another_revision_gives_up_the_awaiting_sandbox_at_once() {
    let mut w = World::new();
    // The upgraded sandbox of pod a, whose object was deleted for the replacement to adopt it.
    w.snap.sandboxes.push(sandbox("sb-a", "uid-a", true, 0));
    w.awaiting.push(Awaiting {
        label_uid: "uid-a".into(),
        namespace: "ns".into(),
        owner_uid: "ds1".into(),
        hash: "h2".into(),
        expired: false,
    });
    // Held while it awaits, as the runtime holds it.
    w.held.insert("uid-a".into());
    // At the revision the sandbox runs: adopted.
    w.add(replacement("h2"));
    assert_eq!(names(&w.decide()), ["Adopt:uid-b"]);
    // The DaemonSet moved on: the replacement starts its own sandbox and the awaiting one is
    // given up now, not at the adopt timeout.
    w.desired.clear();
    w.add(replacement("h3"));
    let acts = names(&w.decide());
    assert!(acts.contains(&"StartPod:uid-b".to_string()), "{acts:?}");
    assert!(
        acts.contains(&"GiveUpAdoption:uid-a".to_string()),
        "{acts:?}"
    );
    // No replacement yet, not expired: it waits.
    w.desired.clear();
    assert!(!names(&w.decide()).contains(&"GiveUpAdoption:uid-a".to_string()));
}
